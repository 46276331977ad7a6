#pragma once
// The command line of the example, benchmark and quality tools (validate_eviction, memory_table,
// kvevict_bench, train_quality, ...): value parsers that take the whole string or throw
// UsageError, and one parse loop for `--flag value` and `--flag=value`, plus dtype and device
// names. ATen and the standard library only (the benchmark builds without fmt); the tools turn
// a UsageError into exit code 2.
#include <ATen/ATen.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace kvevict_cli {

/// A bad command line: an unknown flag, a missing value or a bad value.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// `text` as an integer in [min, max]; the whole string must parse (no spaces, no '+').
inline int64_t parse_int(const std::string& flag, const std::string& text, int64_t min,
                         int64_t max = std::numeric_limits<int64_t>::max()) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec == std::errc::result_out_of_range) throw UsageError(flag + " does not fit in int64, got " + text);
  if (ec != std::errc() || ptr != end || text.empty()) {
    throw UsageError(flag + " expects an integer, got '" + text + "'");
  }
  if (value < min) throw UsageError(flag + " must be >= " + std::to_string(min) + ", got " + text);
  if (value > max) throw UsageError(flag + " must be <= " + std::to_string(max) + ", got " + text);
  return value;
}

/// `text` as a finite double if the whole string parses (no leading spaces, no range error), else NaN.
inline double finite_or_nan(const std::string& text) {
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  const bool blank = text.empty() || std::isspace(static_cast<unsigned char>(text[0]));  // strtod skips spaces
  const double value = blank ? NAN : std::strtod(begin, &end);
  if (end != begin + text.size() || errno == ERANGE || !std::isfinite(value)) return NAN;
  return value;
}

/// `text` as a finite number of seconds > 0; the whole string must parse.
inline double parse_seconds(const std::string& flag, const std::string& text) {
  const double value = finite_or_nan(text);
  if (!(value > 0)) throw UsageError(flag + " expects a finite number of seconds > 0, got '" + text + "'");
  return value;
}

/// `text` as a finite number in [min, max]; the whole string must parse.
inline double parse_double(const std::string& flag, const std::string& text, double min,
                           double max = std::numeric_limits<double>::max()) {
  const double value = finite_or_nan(text);
  if (std::isnan(value)) throw UsageError(flag + " expects a finite number, got '" + text + "'");
  const auto bound = [](double b) {
    char out[32];
    std::snprintf(out, sizeof out, "%g", b);
    return std::string(out);
  };
  if (value < min) throw UsageError(flag + " must be >= " + bound(min) + ", got " + text);
  if (value > max) throw UsageError(flag + " must be <= " + bound(max) + ", got " + text);
  return value;
}

/// "a, b, c".
inline std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

/// `text` if it is one of `choices`.
inline std::string parse_choice(const std::string& flag, const std::string& text,
                                const std::vector<std::string>& choices) {
  for (const auto& c : choices) {
    if (c == text) return text;
  }
  throw UsageError(flag + " must be one of " + join(choices) + ", got '" + text + "'");
}

/// A comma-separated list, each item through parse_item(flag, item); empty items are errors.
template <class ParseItem>
auto parse_list(const std::string& flag, const std::string& text, ParseItem parse_item) {
  std::vector<decltype(parse_item(flag, text))> out;
  if (text.empty()) throw UsageError(flag + " expects a comma-separated list, got ''");
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    out.push_back(parse_item(flag, text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin)));
    if (comma == std::string::npos) return out;
    begin = comma + 1;
  }
}

/// Comma-separated integers, each in [min, max].
inline std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& text, int64_t min,
                                           int64_t max = std::numeric_limits<int64_t>::max()) {
  return parse_list(flag, text,
                    [&](const std::string& f, const std::string& item) { return parse_int(f, item, min, max); });
}

/// Comma-separated choices, each one of `choices`.
inline std::vector<std::string> parse_choice_list(const std::string& flag, const std::string& text,
                                                  const std::vector<std::string>& choices) {
  return parse_list(flag, text,
                    [&](const std::string& f, const std::string& item) { return parse_choice(f, item, choices); });
}

/// make(text) (a constructor or parser that throws on a bad string), its error a UsageError
/// with the first line of the exception's message (c10::Error appends a backtrace after it).
template <class Make>
auto parse_as(const std::string& flag, const std::string& text, Make make) -> decltype(make(text)) {
  try {
    return make(text);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw UsageError(flag + ": bad value '" + text + "': " + what.substr(0, what.find('\n')));
  }
}

/// Fails up front (UsageError) when `path` cannot be opened for writing: opens it to append
/// (nothing written, nothing truncated) and removes it again if it did not exist before.
inline void check_writable(const std::string& flag, const std::string& path) {
  if (path.empty()) throw UsageError(flag + " expects a path");
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  errno = 0;
  {
    std::ofstream probe(path, std::ios::app);
    if (!probe) {
      throw UsageError(flag + ": cannot open '" + path + "' for writing" +
                       (errno != 0 ? std::string(": ") + std::strerror(errno) : std::string()));
    }
  }
  if (!existed) std::filesystem::remove(path, ec);
}

/// Fails up front (UsageError naming the flag) when `path` cannot be opened for reading.
inline void check_readable(const std::string& flag, const std::string& path) {
  errno = 0;
  std::ifstream probe(path, std::ios::binary);
  if (!probe) {
    throw UsageError(flag + ": cannot read '" + path + "'" +
                     (errno != 0 ? std::string(": ") + std::strerror(errno) : std::string()));
  }
}

using FlagSetter = std::function<void(const std::string& flag, const std::string& value)>;
using SwitchSetter = std::function<void()>;

/// Parses argv[1..argc): `--flag value` and `--flag=value` for `flags`, bare `--switch` for
/// `switches`. Throws UsageError on an unknown argument, a missing value, a value given to a
/// switch, or whatever a setter throws. Returns false on --help or -h (the caller prints usage).
inline bool parse_flags(int argc, char** argv, const std::map<std::string, FlagSetter>& flags,
                        const std::map<std::string, SwitchSetter>& switches = {}) {
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    if (flag == "--help" || flag == "-h") return false;
    const auto eq = flag.find('=');
    const bool inline_value = flag.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    if (const auto s = switches.find(flag); s != switches.end()) {
      if (inline_value) throw UsageError(flag + " takes no value, got '" + value + "'");
      s->second();
      continue;
    }
    const auto it = flags.find(flag);
    if (it == flags.end()) throw UsageError("unknown argument '" + flag + "'");
    if (!inline_value) {
      if (i + 1 >= argc) throw UsageError(flag + " expects a value");
      value = argv[++i];
    }
    it->second(flag, value);
  }
  return true;
}

/// "fp32", "fp16" or "bf16" (already checked by parse_choice) as a dtype.
inline at::ScalarType make_dtype(const std::string& name) {
  return name == "fp16" ? at::kHalf : name == "bf16" ? at::kBFloat16 : at::kFloat;
}

/// Any at::Device string ("cpu", "cpu:0", "cuda", "cuda:N", ...), resolved as the caches
/// resolve it: the device a tensor made there reports ("cpu:0" -> "cpu", "cuda" -> "cuda:N").
/// Throws UsageError if it does not parse or is not usable here.
inline at::Device make_device(const std::string& name) {
  const auto device = parse_as("--device", name, [](const std::string& t) { return at::Device(t); });
  if (device.is_cuda() && !at::hasCUDA()) {
    throw UsageError("--device " + name + ": this LibTorch build or machine has no CUDA device");
  }
  return parse_as("--device", name,
                               [&](auto&) { return at::empty({0}, at::TensorOptions().device(device)).device(); });
}

}  // namespace kvevict_cli
