// GEMM tuning: options, counters, plan keys and the tuning-cache file. Host-only: the timing itself lives in the
// cuBLASLt provider (src/kernels/cuda/gemm_lt_tuning.cc), which reaches this through gemm_tuning_internal.h.

#include "gemm_tuning.h"

#include <algorithm>
#include <charconv>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>

#include "gemm_tuning_internal.h"

namespace shardline::kernels {
namespace {

constexpr std::string_view kOp = "GemmTuning";

/// The options in force and the tuning-cache table loaded for them.
struct TuningState {
    std::mutex mutex;
    std::optional<GemmTuningOptions> options; // empty until first read from the environment
    bool table_loaded = false;
    GemmTuningTable table;
    bool warned_write = false;
};

TuningState& State() {
    static TuningState* state = new TuningState(); // never destroyed: plan builds may run during static teardown
    return *state;
}

const GemmTuningOptions& OptionsLocked(TuningState& s) {
    if (!s.options.has_value()) {
        s.options = GemmTuningOptionsFromEnv();
    }
    return *s.options;
}

std::string_view ShortName(DType dtype) {
    if (dtype == DType::kFloat32) {
        return "fp32";
    }
    if (dtype == DType::kFloat16) {
        return "fp16";
    }
    if (dtype == DType::kBFloat16) {
        return "bf16";
    }
    if (dtype == DType::kFloat64) {
        return "fp64";
    }
    return DTypeName(dtype);
}

std::string AlgoHex(std::uint64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, v);
    return buf;
}

std::uint64_t ParseAlgoHex(const std::string& text, std::string_view source, std::size_t index) {
    std::string_view digits(text);
    if (digits.starts_with("0x") || digits.starts_with("0X")) {
        digits.remove_prefix(2);
    }
    std::uint64_t value = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value, 16);
    SHARDLINE_CHECK(!digits.empty() && ec == std::errc() && end == digits.data() + digits.size(), kOp,
                    "{}: record {}: algo words must be hex strings like \"0x00000000000000ff\", got '{}'", source,
                    index, text);
    return value;
}

nlohmann::json RecordToJson(const GemmTuningRecord& r) {
    nlohmann::json algo = nlohmann::json::array();
    for (std::uint64_t w : r.algo) {
        algo.push_back(AlgoHex(w));
    }
    nlohmann::json j = {{"gpu", r.gpu},
                        {"cublaslt", r.cublaslt_version},
                        {"key", r.key},
                        {"algo", algo},
                        {"candidates", r.candidates},
                        {"chosen", r.chosen},
                        {"chosen_us", r.chosen_us},
                        {"first_us", r.first_us}};
    if (r.epilogue_separate || r.epilogue_fused_us != 0.0 || r.epilogue_separate_us != 0.0) {
        j["epilogue"] = r.epilogue_separate ? "separate" : "fused";
        j["epilogue_fused_us"] = r.epilogue_fused_us;
        j["epilogue_separate_us"] = r.epilogue_separate_us;
    }
    if (r.gemv || r.gemv_us != 0.0) {
        j["kernel"] = r.gemv ? "gemv" : "cublaslt";
        j["gemv_us"] = r.gemv_us;
        j["gemv_cublaslt_us"] = r.gemv_cublaslt_us;
    }
    return j;
}

GemmTuningRecord RecordFromJson(const nlohmann::json& j, std::string_view source, std::size_t index) {
    SHARDLINE_CHECK(j.is_object(), kOp, "{}: record {} must be an object, got {}", source, index, j.dump());
    auto need = [&](const char* field) -> const nlohmann::json& {
        SHARDLINE_CHECK(j.contains(field), kOp, "{}: record {} has no \"{}\"", source, index, field);
        return j.at(field);
    };
    GemmTuningRecord r;
    const nlohmann::json& gpu = need("gpu");
    const nlohmann::json& version = need("cublaslt");
    const nlohmann::json& key = need("key");
    const nlohmann::json& algo = need("algo");
    SHARDLINE_CHECK(gpu.is_string() && key.is_string() && version.is_number_integer(), kOp,
                    "{}: record {} needs string \"gpu\" and \"key\" and an integer \"cublaslt\"", source, index);
    SHARDLINE_CHECK(algo.is_array() && algo.size() == r.algo.size(), kOp,
                    "{}: record {}: \"algo\" must be an array of {} hex strings, got {}", source, index, r.algo.size(),
                    algo.dump());
    r.gpu = gpu.get<std::string>();
    r.cublaslt_version = version.get<std::int64_t>();
    r.key = key.get<std::string>();
    for (std::size_t i = 0; i < r.algo.size(); ++i) {
        SHARDLINE_CHECK(algo[i].is_string(), kOp, "{}: record {}: algo word {} must be a hex string, got {}", source,
                        index, i, algo[i].dump());
        r.algo[i] = ParseAlgoHex(algo[i].get<std::string>(), source, index);
    }
    auto number = [&](const char* field, auto fallback) {
        using T = decltype(fallback);
        if (!j.contains(field)) {
            return fallback;
        }
        SHARDLINE_CHECK(j.at(field).is_number(), kOp, "{}: record {}: \"{}\" must be a number, got {}", source, index,
                        field, j.at(field).dump());
        return j.at(field).get<T>();
    };
    r.candidates = number("candidates", 0);
    r.chosen = number("chosen", 0);
    r.chosen_us = number("chosen_us", 0.0);
    r.first_us = number("first_us", 0.0);
    // The epilogue decision; files written before other epilogues were measured name it "bgradb" (BGRADB keys only).
    const bool legacy = !j.contains("epilogue") && j.contains("bgradb");
    const char* mode_field = legacy ? "bgradb" : "epilogue";
    if (j.contains(mode_field)) {
        const nlohmann::json& mode = j.at(mode_field);
        SHARDLINE_CHECK(mode == "fused" || mode == "separate", kOp,
                        "{}: record {}: \"{}\" must be \"fused\" or \"separate\", got {}", source, index, mode_field,
                        mode.dump());
        r.epilogue_separate = mode == "separate";
    }
    r.epilogue_fused_us = number(legacy ? "bgradb_fused_us" : "epilogue_fused_us", 0.0);
    r.epilogue_separate_us = number(legacy ? "bgradb_separate_us" : "epilogue_separate_us", 0.0);
    // Which kernel a matrix-vector product runs; absent in files written before the GEMV: cuBLASLt.
    if (j.contains("kernel")) {
        const nlohmann::json& kernel = j.at("kernel");
        SHARDLINE_CHECK(kernel == "gemv" || kernel == "cublaslt", kOp,
                        "{}: record {}: \"kernel\" must be \"gemv\" or \"cublaslt\", got {}", source, index,
                        kernel.dump());
        r.gemv = kernel == "gemv";
    }
    r.gemv_us = number("gemv_us", 0.0);
    r.gemv_cublaslt_us = number("gemv_cublaslt_us", 0.0);
    return r;
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Options and counters

GemmTuningOptions GemmTuningOptionsFromEnv() {
    GemmTuningOptions o;
    o.enabled = env::GetBool("SHARDLINE_GEMM_TUNING", o.enabled);
    o.top_k = static_cast<int>(env::GetInt("SHARDLINE_GEMM_TUNING_TOP_K", o.top_k, 1, 64));
    if (const auto file = env::Get("SHARDLINE_GEMM_TUNING_FILE")) {
        o.file = *file;
    }
    const std::string gemv = env::GetChoice("SHARDLINE_GEMM_GEMV", "auto", {"auto", "off", "always"});
    o.gemv = gemv == "off" ? GemmGemv::kOff : gemv == "always" ? GemmGemv::kAlways : GemmGemv::kAuto;
    return o;
}

namespace {
thread_local int g_tuning_pauses = 0; // GemmTuningPause scopes open on this thread
} // namespace

GemmTuningPause::GemmTuningPause() { ++g_tuning_pauses; }
GemmTuningPause::~GemmTuningPause() { --g_tuning_pauses; }
namespace detail {
bool GemmTuningPaused() { return g_tuning_pauses > 0; }
} // namespace detail

GemmTuningOptions CurrentGemmTuningOptions() {
    TuningState& s = State();
    std::lock_guard lock(s.mutex);
    GemmTuningOptions options = OptionsLocked(s);
    if (g_tuning_pauses > 0) {
        options.enabled = false;
    }
    return options;
}

void SetGemmTuningOptions(const GemmTuningOptions& options) {
    SHARDLINE_CHECK(options.top_k >= 1 && options.top_k <= 64, kOp, "top_k must be in 1..64, got {}", options.top_k);
    {
        TuningState& s = State();
        std::lock_guard lock(s.mutex);
        s.options = options;
        s.table_loaded = false;
        s.table = GemmTuningTable();
        s.warned_write = false;
    }
    ClearGemmPlanCache();
}

void ClearGemmPlanCache() {
#if SHARDLINE_HAVE_CUDA
    cuda::ClearPlanCache();
#endif
}

std::vector<GemmPlanInfo> GemmPlanInfos() {
#if SHARDLINE_HAVE_CUDA
    return cuda::PlanInfos();
#else
    return {};
#endif
}

GemmPlanStats GetGemmPlanStats() {
    const detail::GemmStatCounters& c = detail::GemmCounters();
    return GemmPlanStats{.plans_built = c.plans_built.load(),
                         .heuristic_queries = c.heuristic_queries.load(),
                         .tuned = c.tuned.load(),
                         .file_hits = c.file_hits.load(),
                         .file_rejected = c.file_rejected.load(),
                         .epilogue_fused = c.epilogue_fused.load(),
                         .epilogue_separate = c.epilogue_separate.load(),
                         .algo_reused = c.algo_reused.load(),
                         .gemv = c.gemv.load(),
                         .rank_one = c.rank_one.load()};
}

void ResetGemmPlanStats() {
    detail::GemmStatCounters& c = detail::GemmCounters();
    c.plans_built = 0;
    c.heuristic_queries = 0;
    c.tuned = 0;
    c.file_hits = 0;
    c.file_rejected = 0;
    c.epilogue_fused = 0;
    c.epilogue_separate = 0;
    c.algo_reused = 0;
    c.gemv = 0;
    c.rank_one = 0;
}

// ---------------------------------------------------------------------------------------------------------------------
// Keys

std::size_t GemmPlanKeyHash::operator()(const GemmPlanKey& key) const noexcept {
    std::uint64_t h = 0xcbf29ce484222325ULL;
    auto mix = [&h](std::uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    mix(static_cast<std::uint64_t>(key.device));
    mix((static_cast<std::uint64_t>(key.tf32) << 0) | (static_cast<std::uint64_t>(key.trans_a) << 1) |
        (static_cast<std::uint64_t>(key.trans_b) << 2) | (static_cast<std::uint64_t>(key.has_bias) << 3) |
        (static_cast<std::uint64_t>(key.beta_zero) << 4) | (static_cast<std::uint64_t>(key.separate_c) << 5) |
        (static_cast<std::uint64_t>(key.epilogue) << 8) | (static_cast<std::uint64_t>(key.a_type) << 16) |
        (static_cast<std::uint64_t>(key.b_type) << 24) | (static_cast<std::uint64_t>(key.c_type) << 32) |
        (static_cast<std::uint64_t>(key.bias_type) << 40));
    mix((static_cast<std::uint64_t>(key.align_a) << 0) | (static_cast<std::uint64_t>(key.align_b) << 12) |
        (static_cast<std::uint64_t>(key.align_c) << 24) | (static_cast<std::uint64_t>(key.align_bias) << 36) |
        (static_cast<std::uint64_t>(key.align_aux) << 48));
    for (std::int64_t v :
         {key.m, key.n, key.k, key.lda, key.ldb, key.ldc, key.ldaux, key.batch, key.stride_a, key.stride_b,
          key.stride_c, key.ldc_in, key.stride_c_in, static_cast<std::int64_t>(key.align_c_in)}) {
        mix(static_cast<std::uint64_t>(v));
    }
    mix(key.workspace);
    return static_cast<std::size_t>(h);
}

std::uint16_t GemmAlignmentClass(const void* ptr, std::int64_t batch, std::int64_t stride_elems, DType dtype) {
    std::uintptr_t bits = reinterpret_cast<std::uintptr_t>(ptr);
    if (batch > 1) {
        bits |= static_cast<std::uintptr_t>(stride_elems) * ElementSize(dtype);
    }
    if (bits == 0) {
        return kMaxAlignmentClass;
    }
    const std::uintptr_t low = bits & (~bits + 1);
    return static_cast<std::uint16_t>(low >= kMaxAlignmentClass ? kMaxAlignmentClass : low);
}

GemmPlanKey MakeGemmPlanKey(const GemmParams& p, bool tf32, std::uint64_t workspace) {
    const bool has_aux = GemmEpilogueHasAux(p.epilogue);
    const bool has_bias = GemmUsesBias(p);
    GemmPlanKey key;
    key.device = p.device.index;
    key.tf32 = tf32 && p.a_type == DType::kFloat32;
    key.trans_a = p.trans_a;
    key.trans_b = p.trans_b;
    key.has_bias = has_bias;
    key.epilogue = p.epilogue;
    key.a_type = p.a_type;
    key.b_type = p.b_type;
    key.c_type = p.c_type;
    key.bias_type = has_bias ? p.bias_type : DType::kFloat32;
    key.beta_zero = p.beta == 0.0;
    key.align_a = GemmAlignmentClass(p.a, p.batch_count, p.stride_a, p.a_type);
    key.align_b = GemmAlignmentClass(p.b, p.batch_count, p.stride_b, p.b_type);
    key.align_c = GemmAlignmentClass(p.c, p.batch_count, p.stride_c, p.c_type);
    key.align_bias = has_bias ? GemmAlignmentClass(p.bias, 1, 0, p.bias_type) : 0;
    key.align_aux = has_aux ? GemmAlignmentClass(p.aux, 1, 0, p.c_type) : 0;
    key.m = p.m;
    key.n = p.n;
    key.k = p.k;
    key.lda = p.lda;
    key.ldb = p.ldb;
    key.ldc = p.ldc;
    key.ldaux = has_aux ? p.ldaux : 0;
    key.batch = p.batch_count;
    key.stride_a = p.batch_count > 1 ? p.stride_a : 0;
    key.stride_b = p.batch_count > 1 ? p.stride_b : 0;
    key.stride_c = p.batch_count > 1 ? p.stride_c : 0;
    // A separate C has its own layout and alignment, which cuBLASLt's algorithm choice reads.
    key.separate_c = GemmHasSeparateC(p);
    if (key.separate_c) {
        key.align_c_in = GemmAlignmentClass(p.c_in, p.batch_count, p.stride_c_in, p.c_type);
        key.ldc_in = p.ldc_in;
        key.stride_c_in = p.batch_count > 1 ? p.stride_c_in : 0;
    }
    key.workspace = workspace;
    return key;
}

std::string GemmPlanKeyString(const GemmPlanKey& key) {
    std::string epilogue(GemmEpilogueName(key.epilogue));
    if (key.has_bias) {
        epilogue += fmt::format("({})", ShortName(key.bias_type));
    }
    std::string s = fmt::format("{}{} m={} n={} k={} ld={},{},{} {},{}->{} compute={} epilogue={} beta={} "
                                "align={},{},{},{},{}",
                                key.trans_a ? 't' : 'n', key.trans_b ? 't' : 'n', key.m, key.n, key.k, key.lda, key.ldb,
                                key.ldc, ShortName(key.a_type), ShortName(key.b_type), ShortName(key.c_type),
                                key.tf32 ? "tf32" : "fp32", epilogue, key.beta_zero ? "0" : "c", key.align_a,
                                key.align_b, key.align_c, key.align_bias, key.align_aux);
    if (key.ldaux != 0) {
        s += fmt::format(" ldaux={}", key.ldaux);
    }
    s += fmt::format(" batch={}", key.batch);
    if (key.batch > 1) {
        s += fmt::format(" stride={},{},{}", key.stride_a, key.stride_b, key.stride_c);
    }
    if (key.separate_c) {
        // Only for a C apart from D, so that the strings (the tuning-file records) of in-place problems are unchanged.
        s += fmt::format(" c_in=ld{},align{}", key.ldc_in, key.align_c_in);
        if (key.batch > 1) {
            s += fmt::format(",stride{}", key.stride_c_in);
        }
    }
    return s;
}

// ---------------------------------------------------------------------------------------------------------------------
// The tuning-cache table

GemmTuningTable GemmTuningTable::Parse(std::string_view text, std::string_view source) {
    nlohmann::json doc;
    try {
        doc = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
        SHARDLINE_THROW(Error, kOp, "{}: not valid JSON ({})", source, e.what());
    }
    SHARDLINE_CHECK(doc.is_object() && doc.contains("format") && doc.at("format") == kGemmTuningFormat, kOp,
                    "{}: expected an object with \"format\": \"{}\"", source, kGemmTuningFormat);
    SHARDLINE_CHECK(doc.contains("version") && doc.at("version").is_number_integer() &&
                        doc.at("version").get<int>() == kGemmTuningFormatVersion,
                    kOp, "{}: expected \"version\": {}, got {}", source, kGemmTuningFormatVersion,
                    doc.contains("version") ? doc.at("version").dump() : std::string("none"));
    SHARDLINE_CHECK(doc.contains("records") && doc.at("records").is_array(), kOp, "{}: expected a \"records\" array",
                    source);
    GemmTuningTable table;
    std::size_t index = 0;
    for (const nlohmann::json& j : doc.at("records")) {
        table.Upsert(RecordFromJson(j, source, index++));
    }
    return table;
}

GemmTuningTable GemmTuningTable::Load(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in.is_open()) {
        if (::access(path.c_str(), F_OK) != 0) {
            return {};
        }
        SHARDLINE_THROW(Error, kOp, "tuning file '{}' exists but cannot be read", path);
    }
    std::stringstream buffer;
    buffer << in.rdbuf();
    return Parse(buffer.str(), path);
}

std::string GemmTuningTable::ToJson() const {
    nlohmann::json records = nlohmann::json::array();
    for (const GemmTuningRecord& r : records_) {
        records.push_back(RecordToJson(r));
    }
    const nlohmann::json doc = {
        {"format", kGemmTuningFormat}, {"version", kGemmTuningFormatVersion}, {"records", records}};
    return doc.dump(1) + "\n";
}

void GemmTuningTable::Save(const std::string& path) const {
    GemmTuningTable merged;
    try {
        merged = Load(path);
    } catch (const Error& e) {
        // A damaged file is replaced rather than blocking every later write.
        Logger().log(spdlog::level::warn, fmt::format("GemmTuning: replacing unreadable tuning file: {}", e.what()));
    }
    for (const GemmTuningRecord& r : records_) {
        merged.Upsert(r);
    }
    const std::string tmp = fmt::format("{}.tmp.{}", path, static_cast<long>(::getpid()));
    {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        SHARDLINE_CHECK(out.is_open(), kOp, "cannot write tuning file '{}' (temporary '{}')", path, tmp);
        out << merged.ToJson();
        out.flush();
        SHARDLINE_CHECK(out.good(), kOp, "writing tuning file '{}' failed", tmp);
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        std::remove(tmp.c_str());
        SHARDLINE_THROW(Error, kOp, "cannot rename '{}' to '{}'", tmp, path);
    }
}

const GemmTuningRecord* GemmTuningTable::Find(std::string_view gpu, std::int64_t cublaslt_version,
                                              std::string_view key) const {
    for (const GemmTuningRecord& r : records_) {
        if (r.cublaslt_version == cublaslt_version && r.key == key && r.gpu == gpu) {
            return &r;
        }
    }
    return nullptr;
}

void GemmTuningTable::Upsert(const GemmTuningRecord& record) {
    for (GemmTuningRecord& r : records_) {
        if (r.cublaslt_version == record.cublaslt_version && r.key == record.key && r.gpu == record.gpu) {
            r = record;
            return;
        }
    }
    records_.push_back(record);
}

// ---------------------------------------------------------------------------------------------------------------------
// The file in force, for the provider

namespace detail {

namespace {
void LoadTableLocked(TuningState& s, const GemmTuningOptions& o) {
    if (s.table_loaded) {
        return;
    }
    s.table_loaded = true;
    try {
        s.table = GemmTuningTable::Load(o.file);
        Logger().log(spdlog::level::info,
                     fmt::format("GemmTuning: {} record(s) from tuning file '{}'", s.table.size(), o.file));
    } catch (const Error& e) {
        Logger().log(spdlog::level::warn,
                     fmt::format("GemmTuning: ignoring the tuning file (plans are tuned afresh): {}", e.what()));
        s.table = GemmTuningTable();
    }
}
} // namespace

GemmStatCounters& GemmCounters() {
    static GemmStatCounters* counters = new GemmStatCounters();
    return *counters;
}

std::optional<GemmTuningRecord> FindTuningRecord(const std::string& gpu, std::int64_t cublaslt_version,
                                                 const std::string& key) {
    TuningState& s = State();
    std::lock_guard lock(s.mutex);
    const GemmTuningOptions& o = OptionsLocked(s);
    if (o.file.empty()) {
        return std::nullopt;
    }
    LoadTableLocked(s, o);
    if (const GemmTuningRecord* r = s.table.Find(gpu, cublaslt_version, key); r != nullptr) {
        return *r;
    }
    return std::nullopt;
}

void StoreTuningRecord(const GemmTuningRecord& record) {
    TuningState& s = State();
    std::lock_guard lock(s.mutex);
    const GemmTuningOptions& o = OptionsLocked(s);
    if (o.file.empty()) {
        return;
    }
    LoadTableLocked(s, o);
    s.table.Upsert(record);
    try {
        s.table.Save(o.file);
    } catch (const Error& e) {
        if (!s.warned_write) {
            s.warned_write = true;
            Logger().log(spdlog::level::warn, fmt::format("GemmTuning: tuning file not written: {}", e.what()));
        }
    }
}

} // namespace detail
} // namespace shardline::kernels
