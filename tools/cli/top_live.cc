// shardctl top, live: the terminal is put in cbreak mode (no echo, no line
// buffering; Ctrl-C still signals) on the alternate screen with the cursor
// hidden, and restored on every way out: q, Ctrl-C / SIGTERM / SIGHUP (exit
// 128 + signal), an error, and a crash (SIGSEGV, SIGABRT, ...: restored, then
// the signal's default action). Ctrl-Z restores it before stopping and
// re-enters on SIGCONT. A background thread fetches the job every --interval,
// so q answers at once even while an RPC waits for an unreachable
// coordinator. The frame itself: tools/cli/top_view.h.
#include "tools/cli/top_live.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "proto/shardopt.pb.h"
#include "tools/cli/top_view.h"

namespace shardopt {
namespace {

constexpr char kTopEnter[] = "\x1b[?1049h\x1b[?25l";  // alternate screen, hide the cursor
constexpr char kTopLeave[] = "\x1b[?25h\x1b[?1049l";  // show the cursor, main screen

struct termios g_top_saved;
volatile sig_atomic_t g_top_raw = 0;     // the terminal is ours to restore
volatile sig_atomic_t g_top_signal = 0;  // SIGINT, SIGTERM, SIGHUP or SIGQUIT received
volatile sig_atomic_t g_top_winch = 0;
volatile sig_atomic_t g_top_tstp = 0;
int g_top_wake[2] = {-1, -1};  // self-pipe: signals and new data wake the loop

void TopWake() {
  if (g_top_wake[1] >= 0) {
    const int saved = errno;
    (void)!write(g_top_wake[1], "x", 1);
    errno = saved;
  }
}

// Async-signal-safe.
void TopRestoreTerminal() {
  if (!g_top_raw) return;
  g_top_raw = 0;
  tcsetattr(STDIN_FILENO, TCSANOW, &g_top_saved);
  (void)!write(STDOUT_FILENO, kTopLeave, sizeof(kTopLeave) - 1);
}

void TopOnQuitSignal(int sig) {
  g_top_signal = sig;
  TopWake();
}
void TopOnWinch(int) {
  g_top_winch = 1;
  TopWake();
}
void TopOnTstp(int) {
  g_top_tstp = 1;
  TopWake();
}
void TopOnFatal(int sig) {  // installed with SA_RESETHAND: the re-raise kills
  TopRestoreTerminal();
  raise(sig);
}

bool TopWriteAll(const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = write(STDOUT_FILENO, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Owns the terminal mode and the signal handlers while `top` runs; the
// destructor puts everything back.
class TopTerminal {
 public:
  TopTerminal() = default;
  TopTerminal(const TopTerminal&) = delete;
  TopTerminal& operator=(const TopTerminal&) = delete;
  ~TopTerminal() {
    TopRestoreTerminal();
    for (auto& [sig, old] : old_actions_) sigaction(sig, &old, nullptr);
    for (int& fd : g_top_wake) {
      if (fd >= 0) close(fd);
      fd = -1;
    }
  }

  absl::Status Start() {
    if (pipe2(g_top_wake, O_CLOEXEC | O_NONBLOCK) != 0) {
      return absl::InternalError(absl::StrCat("top: pipe: ", strerror(errno)));
    }
    Handle(SIGINT, TopOnQuitSignal, 0);
    Handle(SIGTERM, TopOnQuitSignal, 0);
    Handle(SIGHUP, TopOnQuitSignal, 0);
    Handle(SIGQUIT, TopOnQuitSignal, 0);
    Handle(SIGWINCH, TopOnWinch, SA_RESTART);
    Handle(SIGTSTP, TopOnTstp, SA_RESTART);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT})
      Handle(sig, TopOnFatal, SA_RESETHAND);
    return EnterRaw();
  }

  absl::Status EnterRaw() {
    if (tcgetattr(STDIN_FILENO, &g_top_saved) != 0) {
      return absl::FailedPreconditionError(absl::StrCat("top: the terminal: ", strerror(errno)));
    }
    struct termios raw = g_top_saved;
    raw.c_lflag &= ~(ICANON | ECHO);  // ISIG stays: Ctrl-C and Ctrl-Z signal
    raw.c_cc[VMIN] = 1;
    raw.c_cc[VTIME] = 0;
    if (tcsetattr(STDIN_FILENO, TCSANOW, &raw) != 0) {
      return absl::FailedPreconditionError(absl::StrCat("top: the terminal: ", strerror(errno)));
    }
    g_top_raw = 1;
    TopWriteAll(kTopEnter);
    return absl::OkStatus();
  }

  // Ctrl-Z: give the terminal back, stop, take it again when continued.
  absl::Status Suspend() {
    TopRestoreTerminal();
    struct sigaction dfl = {}, mine = {};
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGTSTP, &dfl, &mine);
    raise(SIGTSTP);  // stops here until SIGCONT
    sigaction(SIGTSTP, &mine, nullptr);
    return EnterRaw();
  }

 private:
  void Handle(int sig, void (*fn)(int), int flags) {
    struct sigaction sa = {}, old = {};
    sa.sa_handler = fn;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    if (sigaction(sig, &sa, &old) == 0) old_actions_.push_back({sig, old});
  }
  std::vector<std::pair<int, struct sigaction>> old_actions_;
};

// Fetches the job every `interval` on its own thread; the loop reads the
// latest answer.
class TopPoller {
 public:
  struct Snapshot {
    std::optional<v1::GetJobResponse> job;  // the last answer
    absl::Time job_time;                    // when it came
    absl::Status error;                     // of the last fetch (ok when it answered)
    int64_t fetches = 0;
  };

  TopPoller(CoordinatorClient* client, absl::Duration interval)
      : client_(client), interval_(interval) {
    thread_ = std::thread([this] { Run(); });
  }
  ~TopPoller() {
    if (thread_.joinable() && !Stop(absl::Seconds(30))) thread_.detach();
  }
  // Waits at most `grace` for a fetch in flight; returns false if it is still
  // running (the caller then exits without joining).
  bool Stop(absl::Duration grace) {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
      if (!mu_.AwaitWithTimeout(absl::Condition(&done_), grace)) return false;
    }
    thread_.join();
    return true;
  }
  void Detach() { thread_.detach(); }
  Snapshot Get() {
    absl::MutexLock l(&mu_);
    return snap_;
  }

 private:
  void Run() {
    // An unreachable coordinator fails fast; a silent one costs at most the
    // deadline (q does not wait for it).
    const absl::Duration deadline = std::clamp(interval_, absl::Seconds(1), absl::Seconds(5));
    absl::MutexLock l(&mu_);
    while (!stop_) {
      mu_.Unlock();
      absl::StatusOr<v1::GetJobResponse> job = client_->GetJob(deadline);
      const absl::Time now = absl::Now();
      mu_.Lock();
      ++snap_.fetches;
      snap_.error = job.status();
      if (job.ok()) {
        snap_.job = std::move(*job);
        snap_.job_time = now;
      }
      TopWake();
      mu_.AwaitWithTimeout(absl::Condition(&stop_), interval_);
    }
    done_ = true;
  }

  CoordinatorClient* const client_;
  const absl::Duration interval_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  Snapshot snap_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// The status line of a live frame: "" while the coordinator answers. What
// matters comes first (the line is cut to the width): who, that it retries,
// how old the data on screen is, then the error itself.
std::string TopStatusLine(const TopPoller::Snapshot& s, const std::string& address,
                          absl::Duration interval) {
  if (s.fetches == 0) return absl::StrCat("connecting to the coordinator at ", address, " ...");
  if (s.error.ok()) return "";
  std::string line = absl::StrFormat("error from %s, retrying every %gs", address,
                                     absl::ToDoubleSeconds(interval));
  if (s.job) {
    absl::StrAppend(&line, absl::StrFormat(" (data from %.0fs ago)",
                                           absl::ToDoubleSeconds(absl::Now() - s.job_time)));
  }
  return absl::StrCat(line, ": ", s.error.message());
}

// One write per frame: each row is cleared, then drawn (clearing after the
// text would erase the last column's character); rows below the frame are
// blanked. Nothing is written past the last row (that would scroll).
std::string TopScreen(const std::vector<std::string>& lines, int height) {
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i)
    absl::StrAppend(&out, "\x1b[", i + 1, ";1H\x1b[2K", lines[i]);
  if (static_cast<int>(lines.size()) < height)
    absl::StrAppend(&out, "\x1b[", lines.size() + 1, ";1H\x1b[J");
  return out;
}

void TopTerminalSize(int* width, int* height) {
  struct winsize ws = {};
  *width = 80;
  *height = 24;
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0) {
    *width = ws.ws_col;
    *height = ws.ws_row;
  }
}

int TopFail(const std::string& msg) {
  std::fprintf(stderr, "shardctl: %s\n", msg.c_str());
  return 2;
}

// Draws the current frame.
void TopRedraw(TopPoller& poller, const std::string& address, absl::Duration interval,
               bool highlight) {
  int width, height;
  TopTerminalSize(&width, &height);
  const TopPoller::Snapshot snap = poller.Get();
  TopViewOptions o;
  o.width = width;
  o.height = height;
  o.highlight = highlight;
  o.status = TopStatusLine(snap, address, interval);
  TopWriteAll(TopScreen(RenderTopView(snap.job ? &*snap.job : nullptr, o), height));
}

// What one wake-up of the loop saw.
enum class TopEvent { kNone, kRedraw, kQuit };

// Waits for a key, new data or a signal; *error is set when polling fails.
TopEvent TopWaitForEvent(std::string* error) {
  struct pollfd fds[2] = {{STDIN_FILENO, POLLIN, 0}, {g_top_wake[0], POLLIN, 0}};
  const int n = poll(fds, 2, -1);
  if (n < 0 && errno != EINTR) {
    *error = absl::StrCat("top: poll: ", strerror(errno));
    return TopEvent::kQuit;
  }
  if (n <= 0) return TopEvent::kNone;
  TopEvent event = TopEvent::kNone;
  if (fds[1].revents & POLLIN) {
    char buf[64];
    while (read(g_top_wake[0], buf, sizeof(buf)) > 0) {
    }
    event = TopEvent::kRedraw;  // new data (or a signal, handled by the loop)
  }
  if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
    char keys[64];
    const ssize_t k = read(STDIN_FILENO, keys, sizeof(keys));
    if (k == 0 || (k < 0 && errno != EINTR && errno != EAGAIN)) return TopEvent::kQuit;  // gone
    for (ssize_t i = 0; i < k; ++i) {
      if (keys[i] == 'q' || keys[i] == 'Q') return TopEvent::kQuit;
    }
  }
  return event;
}

// The loop: redraws on new data, resizes and SIGCONT; ends on q, a signal or
// an error. Returns the exit status (128 + signal, or 0); *error is printed
// once the terminal is back.
int TopLoop(TopTerminal& term, TopPoller& poller, const std::string& address,
            absl::Duration interval, bool highlight, std::string* error) {
  bool redraw = true;
  while (true) {
    if (g_top_signal) return 128 + g_top_signal;
    if (g_top_tstp) {
      g_top_tstp = 0;
      if (absl::Status s = term.Suspend(); !s.ok()) {
        *error = std::string(s.message());
        return 0;
      }
      redraw = true;
    }
    if (g_top_winch) {
      g_top_winch = 0;
      redraw = true;
    }
    if (redraw) TopRedraw(poller, address, interval, highlight);
    const TopEvent event = TopWaitForEvent(error);
    if (event == TopEvent::kQuit) return 0;
    redraw = event == TopEvent::kRedraw;
  }
}

}  // namespace

int RunTopLive(CoordinatorClient* client, const std::string& address, absl::Duration interval) {
  if (!isatty(STDIN_FILENO) || !isatty(STDOUT_FILENO)) {
    return TopFail("top: needs a terminal on stdin and stdout (use top --once in scripts)");
  }
  const char* no_color = std::getenv("NO_COLOR");
  const char* term_name = std::getenv("TERM");
  const bool highlight =
      !(no_color && *no_color) && !(term_name && std::string(term_name) == "dumb");
  int code = 0;
  bool joined = true;
  {
    TopTerminal term;
    if (absl::Status s = term.Start(); !s.ok()) return TopFail(std::string(s.message()));
    auto poller = std::make_unique<TopPoller>(client, interval);
    std::string error;
    code = TopLoop(term, *poller, address, interval, highlight, &error);
    // Give the terminal back at once; then wait briefly for a fetch in flight.
    TopRestoreTerminal();
    if (!error.empty()) code = TopFail(error);
    joined = poller->Stop(absl::Milliseconds(300));
    if (!joined) {
      poller->Detach();
      (void)poller.release();  // its thread still uses it; the process ends below
    }
  }
  if (!joined) {
    // A fetch still waits for its deadline: do not wait for it.
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(code);
  }
  return code;
}

}  // namespace shardopt
