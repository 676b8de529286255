// The daemon's life once its config is known (main.cc): the stop and reload
// signals blocked for one signal thread; the daemon started, then its
// listeners in order (the peer service first, so a node whose client socket
// exists can be joined; the Unix socket; the gRPC server and its TCP port;
// metrics; the port file); READY to systemd. SIGHUP reloads the peer TLS
// files; SIGTERM/SIGINT stop accepting, drain running loads (drain_timeout,
// then they fail UNAVAILABLE) and asynchronous saves, and stop.
//
// Called once, from main's thread.
#ifndef CKPTD_SERVER_LIFECYCLE_H_
#define CKPTD_SERVER_LIFECYCLE_H_

#include <string>
#include <vector>

#include "config/config.h"

namespace ckptd {

// Runs the daemon until a stop signal has been handled. Returns the exit
// status; a failure to start is printed as "ckptd: error: ..." (status 1).
int RunDaemon(DaemonConfig config, const std::vector<std::string>& budget_notes);

// Prints "ckptd: error: <msg>" on stderr; returns the exit status 1.
int Fail(const std::string& msg);

}  // namespace ckptd

#endif  // CKPTD_SERVER_LIFECYCLE_H_
