#include "client/checkpoint/zip_reader.h"

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardopt {

std::string QuoteForError(absl::string_view s) {
  constexpr size_t kMax = 80;
  std::string out = absl::StrCat("'", absl::CHexEscape(s.substr(0, kMax)));
  if (s.size() > kMax) absl::StrAppend(&out, "...");
  absl::StrAppend(&out, "'");
  return out;
}

std::string ExceptionOneLine(const std::exception& e) {
  std::string text;
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    text = c10_error->what_without_backtrace();
  } else {
    text = e.what();
  }
  if (text.size() > 300) text = text.substr(0, 300) + "...";
  for (char& c : text) {
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
  }
  return text;
}

// ---------------------------------------------------------------------------
// BoundedReadAdapter

BoundedReadAdapter::~BoundedReadAdapter() {
  if (fd_ >= 0) close(fd_);
}

size_t BoundedReadAdapter::read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const {
  char* out = static_cast<char*>(buf);
  size_t got = 0;
  if (pos < size_) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(n, size_ - pos));
    if (data_ != nullptr) {
      std::memcpy(out, data_ + pos, want);
      got = want;
    } else {
      while (got < want) {
        const ssize_t r = pread(fd_, out + got, want - got, static_cast<off_t>(pos + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += static_cast<size_t>(r);
      }
    }
  }
  if (got < n) std::memset(out + got, 0, n - got);
  return got;
}

// ---------------------------------------------------------------------------
// The central directory

uint64_t LoadLE(const char* p, int n) {
  uint64_t v = 0;
  for (int k = n - 1; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(p[k]);
  return v;
}

namespace {

// Zip record sizes: end of central directory, zip64 locator, zip64 end of
// central directory, central directory entry.
constexpr uint64_t kZipEocd = 22, kZipLocator = 20, kZipEocd64 = 56, kZipCentral = 46;

absl::Status ZipCorrupt(const std::string& name, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(name, ": ", what));
}

// Where the central directory is and how many entries it has, from the end
// of central directory record (zip64's when there is one).
struct ZipDirectory {
  uint64_t entries;
  uint64_t size;
  uint64_t offset;
};

absl::StatusOr<ZipDirectory> FindZipDirectory(const BoundedReadAdapter& in,
                                              const std::string& name) {
  const uint64_t size = in.size();
  if (size < kZipEocd) return ZipCorrupt(name, "too short for a zip archive (truncated?)");
  const uint64_t tail_len = std::min<uint64_t>(size, kZipEocd + 65535);
  std::string tail(tail_len, '\0');
  in.read(size - tail_len, tail.data(), tail_len);
  int64_t at = -1;
  for (int64_t k = static_cast<int64_t>(tail_len - kZipEocd); k >= 0; --k) {
    if (LoadLE(tail.data() + k, 4) == 0x06054b50) {
      at = k;
      break;
    }
  }
  if (at < 0) {
    return ZipCorrupt(name,
                      "no zip end-of-central-directory record (truncated, or not a zip archive)");
  }
  const uint64_t eocd = size - tail_len + static_cast<uint64_t>(at);
  const char* e = tail.data() + at;
  ZipDirectory dir{LoadLE(e + 10, 2), LoadLE(e + 12, 4), LoadLE(e + 16, 4)};
  if (eocd >= kZipLocator + kZipEocd64) {  // zip64, as miniz finds it
    char locator[kZipLocator];
    in.read(eocd - kZipLocator, locator, kZipLocator);
    if (LoadLE(locator, 4) == 0x07064b50) {
      const uint64_t z_ofs = LoadLE(locator + 8, 8);
      if (z_ofs > size - kZipEocd64) {
        return ZipCorrupt(name, "bad zip64 end-of-central-directory locator");
      }
      char z[kZipEocd64];
      in.read(z_ofs, z, kZipEocd64);
      if (LoadLE(z, 4) == 0x06064b50) {
        dir.entries = LoadLE(z + 32, 8);
        dir.size = LoadLE(z + 40, 8);
        dir.offset = LoadLE(z + 48, 8);
      }
    }
  }
  if (dir.offset > size || dir.size > size - dir.offset) {
    return ZipCorrupt(name, "the zip central directory lies outside the file");
  }
  if (dir.entries > dir.size / kZipCentral) {
    return ZipCorrupt(name, "the zip central directory is too small for its entries");
  }
  return dir;
}

// Replaces each of *uncomp, *comp and *local that is 0xFFFFFFFF by its value
// in the zip64 extra field of record `record`.
absl::Status ReadZip64Sizes(absl::string_view extra, const std::string& name,
                            const std::string& record, uint64_t* uncomp, uint64_t* comp,
                            uint64_t* local) {
  while (extra.size() >= 4) {
    const uint64_t id = LoadLE(extra.data(), 2), len = LoadLE(extra.data() + 2, 2);
    if (len > extra.size() - 4) break;
    absl::string_view field = extra.substr(4, len);
    extra.remove_prefix(4 + len);
    if (id != 1) continue;
    for (uint64_t* v : {uncomp, comp, local}) {
      if (*v != 0xFFFFFFFF) continue;
      if (field.size() < 8) {
        return ZipCorrupt(name, absl::StrCat("bad zip64 sizes for record ", QuoteForError(record)));
      }
      *v = LoadLE(field.data(), 8);
      field.remove_prefix(8);
    }
    return absl::OkStatus();
  }
  return ZipCorrupt(name, absl::StrCat("no zip64 sizes for record ", QuoteForError(record)));
}

struct ZipRecord {
  std::string name;
  uint64_t local;  // offset of the local header
  uint64_t size;
};

// Reads and checks the central directory entry at cd[*p] (the archive is
// `size` bytes long) and moves *p past it.
absl::StatusOr<ZipRecord> ReadZipEntry(absl::string_view cd, size_t* p, uint64_t size,
                                       const std::string& name) {
  if (cd.size() - *p < kZipCentral || LoadLE(cd.data() + *p, 4) != 0x02014b50) {
    return ZipCorrupt(name, "bad zip central directory entry");
  }
  const char* h = cd.data() + *p;
  const uint64_t flags = LoadLE(h + 8, 2), method = LoadLE(h + 10, 2), external = LoadLE(h + 38, 4);
  uint64_t comp = LoadLE(h + 20, 4), uncomp = LoadLE(h + 24, 4), local = LoadLE(h + 42, 4);
  const size_t name_len = LoadLE(h + 28, 2), extra_len = LoadLE(h + 30, 2),
               comment_len = LoadLE(h + 32, 2);
  if (cd.size() - *p - kZipCentral < name_len + extra_len + comment_len) {
    return ZipCorrupt(name, "bad zip central directory entry");
  }
  const std::string record(h + kZipCentral, name_len);
  if (uncomp == 0xFFFFFFFF || comp == 0xFFFFFFFF || local == 0xFFFFFFFF) {
    const absl::string_view extra(h + kZipCentral + name_len, extra_len);
    SHARDOPT_RETURN_IF_ERROR(ReadZip64Sizes(extra, name, record, &uncomp, &comp, &local));
  }
  if (method != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": record ", QuoteForError(record), " is compressed (zip method ", method,
        "); torch.save stores records uncompressed (was the file re-zipped?)"));
  }
  if (flags & 0x61) {  // encrypted, strongly encrypted, compressed patch data
    return ZipCorrupt(
        name, absl::StrCat("record ", QuoteForError(record), " is encrypted or patch data"));
  }
  if (comp != uncomp) {
    return ZipCorrupt(name,
                      absl::StrCat("record ", QuoteForError(record), " has inconsistent sizes"));
  }
  // miniz "extracts" a directory as nothing, leaving the buffer it
  // allocated for the declared size uninitialized.
  if (uncomp != 0 && ((external & 0x10) || absl::EndsWith(record, "/"))) {
    return ZipCorrupt(name,
                      absl::StrCat("record ", QuoteForError(record), " is marked as a directory"));
  }
  if (local > size || uncomp > size - local) {
    return ZipCorrupt(name, absl::StrCat("record ", QuoteForError(record), " (", uncomp,
                                         " bytes) runs past the end of the file"));
  }
  *p += kZipCentral + name_len + extra_len + comment_len;
  return ZipRecord{record, local, uncomp};
}

// Checks the version record as PyTorchStreamReader's constructor would once
// miniz has opened the archive: present, and a format this LibTorch reads.
absl::Status CheckZipVersion(const BoundedReadAdapter& in, const std::string& name,
                             const std::vector<ZipRecord>& records,
                             const std::unordered_map<std::string, size_t>& by_name,
                             const std::string& prefix) {
  const uint64_t size = in.size();
  auto version = by_name.find(prefix + ".data/version");
  if (version == by_name.end()) version = by_name.find(prefix + "version");
  if (version == by_name.end()) return ZipCorrupt(name, "the zip archive has no version record");
  const ZipRecord& v = records[version->second];
  char local[30];
  if (v.size > 32 || in.read(v.local, local, 30) != 30 || LoadLE(local, 4) != 0x04034b50) {
    return ZipCorrupt(name, "bad version record");
  }
  const uint64_t data = v.local + 30 + LoadLE(local + 26, 2) + LoadLE(local + 28, 2);
  std::string text(v.size, '\0');
  if (data > size || v.size > size - data || in.read(data, text.data(), v.size) != v.size) {
    return ZipCorrupt(name, "bad version record");
  }
  // As std::stoull reads it: blanks, then digits.
  size_t k = 0;
  while (k < text.size() && absl::ascii_isspace(text[k])) ++k;
  if (k < text.size() && text[k] == '+') ++k;
  uint64_t format = 0;
  size_t digits = 0;
  for (; k < text.size() && absl::ascii_isdigit(text[k]) && digits < 19; ++k, ++digits) {
    format = format * 10 + (text[k] - '0');
  }
  if (digits == 0 || digits == 19) {
    return ZipCorrupt(name, absl::StrCat("bad version record ", QuoteForError(text)));
  }
  if (format < caffe2::serialize::kMinSupportedFileFormatVersion ||
      format > caffe2::serialize::kMaxSupportedFileFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": archive format version ", format, "; this LibTorch reads versions ",
                     caffe2::serialize::kMinSupportedFileFormatVersion, " to ",
                     caffe2::serialize::kMaxSupportedFileFormatVersion));
  }
  return absl::OkStatus();
}

// The records of a checked archive: what PyTorchStreamReader calls "name" is
// prefix + name, looked up regardless of case.
struct ZipIndex {
  std::string prefix;                               // lowercased, with its '/'
  std::unordered_map<std::string, uint64_t> sizes;  // lowercased name -> bytes
};

// Checks the zip's central directory before miniz acts on it: every record
// stored (torch.save never compresses) and inside the file, names unique.
// miniz allocates a record's declared size before reading it; this keeps
// that within the file, and *index lets a caller check a record's size
// before it is read.
absl::Status CheckZipDirectory(const BoundedReadAdapter& in, const std::string& name,
                               ZipIndex* index) {
  SHARDOPT_ASSIGN_OR_RETURN(const ZipDirectory dir, FindZipDirectory(in, name));
  std::string cd(dir.size, '\0');
  if (in.read(dir.offset, cd.data(), dir.size) != dir.size) {
    return ZipCorrupt(name, "cannot read the zip central directory");
  }
  std::vector<ZipRecord> records;
  std::unordered_map<std::string, size_t> by_name;  // lowercased, as miniz looks names up
  size_t p = 0;
  for (uint64_t k = 0; k < dir.entries; ++k) {
    SHARDOPT_ASSIGN_OR_RETURN(ZipRecord record, ReadZipEntry(cd, &p, in.size(), name));
    if (!by_name.emplace(absl::AsciiStrToLower(record.name), records.size()).second) {
      return ZipCorrupt(name,
                        absl::StrCat("record ", QuoteForError(record.name), " appears twice"));
    }
    records.push_back(std::move(record));
  }
  // What PyTorchStreamReader's constructor checks once miniz has opened the
  // archive, checked here first: when the constructor throws there, it leaks
  // miniz's state.
  if (records.empty()) return ZipCorrupt(name, "the zip archive holds no records");
  const size_t slash = records[0].name.find('/');
  if (slash == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": a zip archive whose records are not in a folder, not a torch.save file"));
  }
  index->prefix = absl::AsciiStrToLower(records[0].name.substr(0, slash + 1));
  for (const auto& [lower, k] : by_name) index->sizes.emplace(lower, records[k].size);
  return CheckZipVersion(in, name, records, by_name, index->prefix);
}

}  // namespace

// ---------------------------------------------------------------------------
// TorchZipReader

absl::StatusOr<std::unique_ptr<TorchZipReader>> TorchZipReader::Open(
    std::shared_ptr<BoundedReadAdapter> in, const std::string& name) {
  ZipIndex index;
  SHARDOPT_RETURN_IF_ERROR(CheckZipDirectory(*in, name, &index));
  std::unique_ptr<TorchZipReader> zip(new TorchZipReader());
  zip->file_size_ = in->size();
  zip->prefix_ = std::move(index.prefix);
  zip->sizes_ = std::move(index.sizes);
  try {
    zip->reader_ = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
        std::static_pointer_cast<caffe2::serialize::ReadAdapterInterface>(std::move(in)));
  } catch (const std::exception& e) {
    return absl::DataLossError(
        absl::StrCat(name, ": not a readable torch.save archive: ", ExceptionOneLine(e)));
  }
  return zip;
}

TorchZipReader::~TorchZipReader() = default;

std::optional<uint64_t> TorchZipReader::RecordSize(const std::string& record) const {
  const auto entry = sizes_.find(prefix_ + absl::AsciiStrToLower(record));
  if (entry == sizes_.end()) return std::nullopt;
  return entry->second;
}

bool TorchZipReader::HasRecord(const std::string& record) { return reader_->hasRecord(record); }

std::tuple<at::DataPtr, size_t> TorchZipReader::GetRecord(const std::string& record) {
  return reader_->getRecord(record);
}

}  // namespace shardopt
