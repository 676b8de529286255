// Test certificates for the peer plane's mutual TLS, made at test time with
// Debian's openssl: two CAs and leaf certificates with chosen SANs.
#ifndef CKPTD_TESTS_INTEGRATION_CERTS_H_
#define CKPTD_TESTS_INTEGRATION_CERTS_H_

#include <cstdlib>
#include <fstream>
#include <string>

namespace ckpt::testing {

struct CertFiles {
  std::string cert, key, ca;  // paths
};

// Runs `script` with /bin/sh in `dir`; true on exit 0.
inline bool RunShell(const std::string& dir, const std::string& script) {
  const std::string file = dir + "/run.sh";
  std::ofstream(file) << "set -e\ncd '" << dir << "'\n" << script << "\n";
  return std::system(("/bin/sh '" + file + "' >'" + dir + "/openssl.log' 2>&1").c_str()) == 0;
}

// A CA named `name` in dir/name.{crt,key}.
inline bool MakeCa(const std::string& dir, const std::string& name) {
  return RunShell(dir, "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
                       "-keyout " + name + ".key -out " + name + ".crt -days 2 -subj /CN=" + name);
}

// A leaf certificate `name` signed by CA `ca` (MakeCa) with `san` (e.g.
// "IP:127.0.0.1" or "DNS:intruder.example"), for server and client use.
inline CertFiles MakeLeaf(const std::string& dir, const std::string& ca, const std::string& name,
                          const std::string& san) {
  const bool ok = RunShell(
      dir, "printf 'subjectAltName=" + san +
               "\\nextendedKeyUsage=serverAuth,clientAuth\\n' > " + name + ".ext\n"
               "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " +
               name + ".key -out " + name + ".csr -subj /CN=" + name + "\n" +
               "openssl x509 -req -in " + name + ".csr -CA " + ca + ".crt -CAkey " + ca +
               ".key -CAcreateserial -out " + name + ".crt -days 2 -extfile " + name + ".ext");
  if (!ok) return {};
  return {dir + "/" + name + ".crt", dir + "/" + name + ".key", dir + "/" + ca + ".crt"};
}

// The subject CN of the certificate the TLS server at `address` presents
// (to a client with `client`'s certificate), or "" if the handshake fails.
inline std::string ServerCertName(const std::string& dir, const std::string& address,
                                  const CertFiles& client) {
  const std::string out = dir + "/s_client.out";
  RunShell(dir, "echo | openssl s_client -connect " + address + " -alpn h2 -cert " + client.cert +
                    " -key " + client.key + " -CAfile " + client.ca +
                    " 2>/dev/null | openssl x509 -noout -subject -nameopt multiline > " + out +
                    " || true");
  std::ifstream in(out);
  std::string line, name;
  while (std::getline(in, line)) {
    const size_t eq = line.find("commonName");
    if (eq != std::string::npos) name = line.substr(line.find('=', eq) + 1);
  }
  while (!name.empty() && name.front() == ' ') name.erase(name.begin());
  return name;
}

}  // namespace ckpt::testing

#endif  // CKPTD_TESTS_INTEGRATION_CERTS_H_
