// libFuzzer entry point for shardline-spmd requests, built only when the C++ compiler is clang (tests/spmd): each input
// is one request text; a finding (spmd_fuzz.h RunOne) aborts, as does any sanitizer report or libFuzzer's timeout.
//     shardline_spmd_libfuzzer -max_total_time=600 -timeout=5 CORPUS_DIR   (seeds: shardline_spmd_fuzz --write-seeds)

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "spmd_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const std::string_view text(reinterpret_cast<const char *>(data), size);
    const shardline::spmd::fuzz::Outcome outcome = shardline::spmd::fuzz::RunOne(text);
    if (!outcome.finding.empty()) {
        std::fprintf(stderr, "shardline_spmd_libfuzzer: %s\n", outcome.finding.c_str());
        std::abort();
    }
    return 0;
}
