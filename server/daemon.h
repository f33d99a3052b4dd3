/* daemon: the event loop of dilocod.  Data flows one way: transport -> intake (validated copy in the
 * cache) -> round -> aggregation job (thread pool) -> commit -> publish.  The loop thread only
 * decides; every file operation runs on the libuv thread pool. */
#ifndef DAEMON_H
#define DAEMON_H

#include "config.h"

/* Runs until SIGINT/SIGTERM.  Returns the process exit code. */
int daemon_run(config *cfg);

#endif
