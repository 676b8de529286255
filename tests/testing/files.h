// Test helpers: a whole file as a string, and a string as a whole file.
#ifndef CKPTD_TESTS_TESTING_FILES_H_
#define CKPTD_TESTS_TESTING_FILES_H_

#include <fstream>
#include <sstream>
#include <string>

namespace ckpt::testing {

inline std::string Slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline void Spit(const std::string& path, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << data;
}

}  // namespace ckpt::testing

#endif  // CKPTD_TESTS_TESTING_FILES_H_
