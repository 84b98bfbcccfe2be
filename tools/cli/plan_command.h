// `shardctl plan`: the partition advisor's command line (advisor/cost_model.h).
#ifndef SHARDOPT_TOOLS_CLI_PLAN_COMMAND_H_
#define SHARDOPT_TOOLS_CLI_PLAN_COMMAND_H_

namespace shardopt {

// argv[0] is "plan"; exit status 0, 1 (bad input file) or 2 (bad flags).
int PlanMain(int argc, char** argv);

}  // namespace shardopt

#endif  // SHARDOPT_TOOLS_CLI_PLAN_COMMAND_H_
