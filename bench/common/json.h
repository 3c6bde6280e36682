// A tiny JSON writer for benchmark results (no dependency): objects of numbers and strings.
#pragma once

#include <cstdio>
#include <ctime>
#include <sstream>
#include <string>
#include <vector>

namespace sy_bench {

inline std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (c == '\n') { o += "\\n"; continue; }
    o += c;
  }
  return o;
}

// One flat JSON object, built field by field.
class JsonObject {
 public:
  JsonObject& str(const std::string& k, const std::string& v) { return raw(k, "\"" + json_escape(v) + "\""); }
  JsonObject& num(const std::string& k, double v) {
    std::ostringstream s;
    s.precision(6);
    s << v;
    return raw(k, s.str());
  }
  JsonObject& boolean(const std::string& k, bool v) { return raw(k, v ? "true" : "false"); }
  JsonObject& raw(const std::string& k, const std::string& v) {
    body_ += (body_.empty() ? "" : ", ") + ("\"" + json_escape(k) + "\": " + v);
    return *this;
  }
  std::string dump() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

inline std::string json_array(const std::vector<std::string>& items) {
  std::string o = "[\n";
  for (size_t i = 0; i < items.size(); ++i) o += "  " + items[i] + (i + 1 < items.size() ? ",\n" : "\n");
  return o + "]";
}

inline std::string utc_now() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

}  // namespace sy_bench
