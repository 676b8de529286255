// A free TCP port on loopback for a test daemon.
#ifndef CKPTD_TESTS_INTEGRATION_PORTS_H_
#define CKPTD_TESTS_INTEGRATION_PORTS_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace ckpt::testing {

inline int FreePort() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

}  // namespace ckpt::testing

#endif  // CKPTD_TESTS_INTEGRATION_PORTS_H_
