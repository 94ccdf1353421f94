// The host side of GEMM tuning: plan keys and their text form, the tuning-cache file (parse, write, merge, errors) and
// the options read from the environment. No GPU needed: the timing itself is tested in tests/cuda.

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <shardline/core/error.h>

#include "kernels/gemm_tuning.h"

namespace shardline::kernels {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

/// Sets (or unsets) an environment variable for the scope's lifetime.
class ScopedEnv {
public:
    ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
        if (const char* old = std::getenv(name); old != nullptr) {
            old_ = std::string(old);
        }
        Apply(value);
    }
    ~ScopedEnv() { Apply(old_); }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

private:
    void Apply(const std::optional<std::string>& value) {
        if (value.has_value()) {
            ::setenv(name_, value->c_str(), 1);
        } else {
            ::unsetenv(name_);
        }
    }
    const char* name_;
    std::optional<std::string> old_;
};

/// A fresh directory under the system temp dir, removed with its contents at scope exit.
class TempDir {
public:
    TempDir() {
        std::string pattern = (std::filesystem::temp_directory_path() / "shardline_tuning_XXXXXX").string();
        path_ = ::mkdtemp(pattern.data());
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }
    std::string File(const std::string& name) const { return (std::filesystem::path(path_) / name).string(); }

private:
    std::string path_;
};

void WriteFile(const std::string& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
}

/// The forward GEMM of a Linear layer x [4096, 4096] · W [8192, 4096]ᵀ + b in bf16 (see linear.cc), pointers 256-byte
/// aligned as pool allocations are.
GemmParams ForwardParams() {
    return GemmParams{.trans_a = true,
                      .m = 8192,
                      .n = 4096,
                      .k = 4096,
                      .a = reinterpret_cast<const void*>(std::uintptr_t{0x10000}),
                      .lda = 4096,
                      .a_type = DType::kBFloat16,
                      .b = reinterpret_cast<const void*>(std::uintptr_t{0x20000}),
                      .ldb = 4096,
                      .b_type = DType::kBFloat16,
                      .c = reinterpret_cast<void*>(std::uintptr_t{0x30000}),
                      .ldc = 8192,
                      .c_type = DType::kBFloat16,
                      .epilogue = GemmEpilogue::kBias,
                      .bias = reinterpret_cast<void*>(std::uintptr_t{0x40000}),
                      .bias_type = DType::kBFloat16,
                      .device = Device::CUDA(0)};
}

GemmTuningRecord SampleRecord(std::string key, std::uint64_t word0) {
    GemmTuningRecord r;
    r.gpu = "NVIDIA H100 80GB HBM3";
    r.cublaslt_version = 130100;
    r.key = std::move(key);
    r.algo = {word0, 2, 3, 4, 5, 6, 7, 0xffffffffffffffffULL};
    r.candidates = 8;
    r.chosen = 3;
    r.chosen_us = 101.5;
    r.first_us = 120.25;
    return r;
}

// ---------------------------------------------------------------------------------------------------------------------
// Keys

TEST(GemmPlanKeyTest, KeyStringOfALinearForwardIsStable) {
    // The text is the tuning file's key: changing it silently would orphan every stored record.
    const GemmPlanKey key = MakeGemmPlanKey(ForwardParams(), /*tf32=*/false, 32u << 20);
    EXPECT_EQ(GemmPlanKeyString(key), "tn m=8192 n=4096 k=4096 ld=4096,4096,8192 bf16,bf16->bf16 compute=fp32 "
                                      "epilogue=bias(bf16) beta=0 align=256,256,256,256,0 batch=1");
}

TEST(GemmPlanKeyTest, EveryFieldThatChangesThePlanChangesTheKeyString) {
    const GemmParams base = ForwardParams();
    std::vector<GemmParams> variants(1, base);
    auto vary = [&](auto&& change) {
        GemmParams p = base;
        change(p);
        variants.push_back(p);
    };
    vary([](GemmParams& p) { p.trans_a = false; });
    vary([](GemmParams& p) { p.trans_b = true; });
    vary([](GemmParams& p) {
        p.m = 8200;
        p.ldc = 8200;
    });
    vary([](GemmParams& p) { p.n = 4097; });
    vary([](GemmParams& p) {
        p.k = 4104;
        p.lda = 4104;
        p.ldb = 4104;
    });
    vary([](GemmParams& p) { p.lda = 4160; });
    vary([](GemmParams& p) { p.ldb = 4160; });
    vary([](GemmParams& p) { p.ldc = 8256; });
    vary([](GemmParams& p) { p.a_type = p.b_type = p.c_type = p.bias_type = DType::kFloat16; });
    vary([](GemmParams& p) { p.c_type = DType::kFloat32; });
    vary([](GemmParams& p) {
        p.epilogue = GemmEpilogue::kNone;
        p.bias = nullptr;
    });
    vary([](GemmParams& p) { p.epilogue = GemmEpilogue::kBGradB; });
    vary([](GemmParams& p) {
        p.bias = nullptr;
        p.epilogue = GemmEpilogue::kGeluAuxBias;
        p.aux = p.c;
        p.ldaux = 8192;
    });
    vary([](GemmParams& p) {
        p.epilogue = GemmEpilogue::kDGeluBGrad;
        p.aux = p.c;
        p.ldaux = 8192;
    });
    vary([](GemmParams& p) {
        p.epilogue = GemmEpilogue::kDGelu;
        p.aux = p.c;
        p.ldaux = 8192;
    });
    vary([](GemmParams& p) { p.beta = 1.0; });
    vary([](GemmParams& p) { p.a = reinterpret_cast<const char*>(p.a) + 2; });
    vary([](GemmParams& p) { p.b = reinterpret_cast<const char*>(p.b) + 4; });
    vary([](GemmParams& p) { p.c = reinterpret_cast<char*>(p.c) + 8; });
    vary([](GemmParams& p) { p.bias = reinterpret_cast<char*>(p.bias) + 2; });
    vary([](GemmParams& p) {
        p.batch_count = 2;
        p.stride_a = 1 << 24;
        p.stride_b = 1 << 24;
        p.stride_c = 1 << 25;
    });
    // A separate C (a residual): its presence, leading dim and alignment.
    const auto separate = [](GemmParams& p) {
        p.beta = 1.0;
        p.c_in = reinterpret_cast<const void*>(std::uintptr_t{0x80000000});
        p.ldc_in = 8192;
    };
    vary(separate);
    vary([&](GemmParams& p) {
        separate(p);
        p.ldc_in = 8256;
    });
    vary([&](GemmParams& p) {
        separate(p);
        p.c_in = reinterpret_cast<const char*>(p.c_in) + 16;
    });
    std::set<std::string> strings;
    for (const GemmParams& p : variants) {
        strings.insert(GemmPlanKeyString(MakeGemmPlanKey(p, false)));
    }
    EXPECT_EQ(strings.size(), variants.size());
    // fp32 operands: TF32 is part of the key; for bf16 operands the flag is meaningless and ignored.
    GemmParams fp32 = base;
    fp32.a_type = fp32.b_type = fp32.c_type = fp32.bias_type = DType::kFloat32;
    EXPECT_NE(GemmPlanKeyString(MakeGemmPlanKey(fp32, true)), GemmPlanKeyString(MakeGemmPlanKey(fp32, false)));
    EXPECT_EQ(MakeGemmPlanKey(base, true), MakeGemmPlanKey(base, false));
}

TEST(GemmPlanKeyTest, ASeparateCIsAppendedAndCGivenAsDIsTheInPlaceKey) {
    GemmParams in_place = ForwardParams();
    in_place.beta = 1.0;
    GemmParams separate = in_place;
    separate.c_in = reinterpret_cast<const void*>(std::uintptr_t{0x80000000});
    separate.ldc_in = 8192;
    EXPECT_EQ(GemmPlanKeyString(MakeGemmPlanKey(separate, false)),
              GemmPlanKeyString(MakeGemmPlanKey(in_place, false)) + " c_in=ld8192,align256");
    // C given as D itself, or a C that beta = 0 never reads, is the in-place problem's key.
    GemmParams same = in_place;
    same.c_in = same.c;
    same.ldc_in = same.ldc;
    EXPECT_EQ(MakeGemmPlanKey(same, false), MakeGemmPlanKey(in_place, false));
    GemmParams unread = separate;
    unread.beta = 0.0;
    EXPECT_EQ(MakeGemmPlanKey(unread, false), MakeGemmPlanKey(ForwardParams(), false));
}

TEST(GemmPlanKeyTest, BetaValueAndWorkspaceStayOutOfTheKeyString) {
    GemmParams one = ForwardParams();
    one.beta = 1.0;
    GemmParams half = one;
    half.beta = 0.5;
    EXPECT_EQ(GemmPlanKeyString(MakeGemmPlanKey(one, false)), GemmPlanKeyString(MakeGemmPlanKey(half, false)));
    // The workspace separates in-memory plans but not file records (a record is checked against the workspace).
    const GemmPlanKey small = MakeGemmPlanKey(ForwardParams(), false, 1u << 20);
    const GemmPlanKey large = MakeGemmPlanKey(ForwardParams(), false, 32u << 20);
    EXPECT_NE(small, large);
    EXPECT_NE(GemmPlanKeyHash{}(small), GemmPlanKeyHash{}(large));
    EXPECT_EQ(GemmPlanKeyString(small), GemmPlanKeyString(large));
}

TEST(GemmPlanKeyTest, VectorsOfAnEpilogueThatIsNotRunStayOutOfTheKey) {
    // No epilogue: a stray bias pointer (and its alignment) must not split plans.
    GemmParams a = ForwardParams();
    a.epilogue = GemmEpilogue::kNone;
    GemmParams b = a;
    b.bias = reinterpret_cast<void*>(std::uintptr_t{0x40002});
    EXPECT_EQ(MakeGemmPlanKey(a, false), MakeGemmPlanKey(b, false));
}

TEST(GemmPlanKeyTest, AlignmentClassIsTheLargestPowerOfTwoUpTo256) {
    auto at = [](std::uintptr_t address) { return reinterpret_cast<const void*>(address); };
    EXPECT_EQ(GemmAlignmentClass(at(0x10000), 1, 0, DType::kBFloat16), 256);
    EXPECT_EQ(GemmAlignmentClass(at(0x10080), 1, 0, DType::kBFloat16), 128);
    EXPECT_EQ(GemmAlignmentClass(at(0x1010), 1, 0, DType::kBFloat16), 16);
    EXPECT_EQ(GemmAlignmentClass(at(0x1008), 1, 0, DType::kBFloat16), 8);
    EXPECT_EQ(GemmAlignmentClass(at(0x1002), 1, 0, DType::kBFloat16), 2);
    EXPECT_EQ(GemmAlignmentClass(nullptr, 1, 0, DType::kFloat32), 256);
    // Batched: the stride in bytes counts too (an odd bf16 stride makes every other matrix 2-byte aligned).
    EXPECT_EQ(GemmAlignmentClass(at(0x10000), 2, 3, DType::kBFloat16), 2);
    EXPECT_EQ(GemmAlignmentClass(at(0x10000), 2, 64, DType::kBFloat16), 128);
    EXPECT_EQ(GemmAlignmentClass(at(0x10000), 1, 3, DType::kBFloat16), 256);
}

// ---------------------------------------------------------------------------------------------------------------------
// The tuning-cache table

TEST(GemmTuningTableTest, JsonRoundTripKeepsEveryField) {
    GemmTuningTable table;
    table.Upsert(SampleRecord("key one", 1));
    GemmTuningRecord bgrad = SampleRecord("nt m=1 n=2 k=3 epilogue=bgradb(bf16)", 0x0123456789abcdefULL);
    bgrad.epilogue_separate = true;
    bgrad.epilogue_fused_us = 50.5;
    bgrad.epilogue_separate_us = 40.0;
    table.Upsert(bgrad);
    GemmTuningRecord dgelu = SampleRecord("nn m=1 n=2 k=3 epilogue=dgelu_bgrad(bf16)", 7);
    dgelu.epilogue_fused_us = 30.0;
    dgelu.epilogue_separate_us = 45.25;
    table.Upsert(dgelu);
    const GemmTuningTable back = GemmTuningTable::Parse(table.ToJson());
    ASSERT_EQ(back.size(), 3u);
    EXPECT_EQ(back.records()[0], table.records()[0]);
    EXPECT_EQ(back.records()[1], table.records()[1]);
    EXPECT_EQ(back.records()[2], table.records()[2]);
    EXPECT_THAT(table.ToJson(), HasSubstr("\"0x0123456789abcdef\""));
    EXPECT_THAT(table.ToJson(), HasSubstr("\"epilogue\": \"separate\""));
    EXPECT_THAT(table.ToJson(), HasSubstr("\"epilogue\": \"fused\""));
}

TEST(GemmTuningTableTest, RecordsOfTheFormerBGradBFieldsAreRead) {
    // Files written before every measured epilogue shared the "epilogue" fields name the BGRADB decision "bgradb".
    const GemmTuningTable table = GemmTuningTable::Parse(
        R"json({"format": "shardline-gemm-tuning", "version": 1, "records": [{"gpu": "g", "cublaslt": 1,
            "key": "nt m=1 n=2 k=3 epilogue=bgradb(bf16)", "bgradb": "separate", "bgradb_fused_us": 50.5,
            "bgradb_separate_us": 40.0, "algo": ["0x1","0x2","0x3","0x4","0x5","0x6","0x7","0x8"]}]})json");
    ASSERT_EQ(table.size(), 1u);
    const GemmTuningRecord& r = table.records()[0];
    EXPECT_TRUE(r.epilogue_separate);
    EXPECT_EQ(r.epilogue_fused_us, 50.5);
    EXPECT_EQ(r.epilogue_separate_us, 40.0);
    EXPECT_THAT(table.ToJson(), HasSubstr("\"epilogue\": \"separate\""));
}

TEST(GemmTuningTableTest, RecordsAreKeyedByGpuLibraryVersionAndKey) {
    GemmTuningTable table;
    table.Upsert(SampleRecord("k", 1));
    GemmTuningRecord other_gpu = SampleRecord("k", 2);
    other_gpu.gpu = "NVIDIA H200";
    table.Upsert(other_gpu);
    GemmTuningRecord other_version = SampleRecord("k", 3);
    other_version.cublaslt_version = 130000;
    table.Upsert(other_version);
    EXPECT_EQ(table.size(), 3u);
    table.Upsert(SampleRecord("k", 4)); // replaces the first
    EXPECT_EQ(table.size(), 3u);
    const GemmTuningRecord* found = table.Find("NVIDIA H100 80GB HBM3", 130100, "k");
    ASSERT_NE(found, nullptr);
    EXPECT_EQ(found->algo[0], 4u);
    EXPECT_EQ(table.Find("NVIDIA H200", 130100, "k")->algo[0], 2u);
    EXPECT_EQ(table.Find("NVIDIA H100 80GB HBM3", 130000, "k")->algo[0], 3u);
    EXPECT_EQ(table.Find("NVIDIA H100 80GB HBM3", 130100, "other"), nullptr);
    EXPECT_EQ(table.Find("NVIDIA A100", 130100, "k"), nullptr);
}

/// The message GemmTuningTable::Parse throws for `text` (read as "t.json"), or "accepted".
std::string ParseError(const std::string& text) {
    try {
        (void)GemmTuningTable::Parse(text, "t.json");
    } catch (const Error& e) {
        return e.what();
    }
    return "accepted";
}

TEST(GemmTuningTableTest, MalformedFilesAreRefusedWithTheReason) {
    const auto error = ParseError;
    EXPECT_THAT(error("{"), HasSubstr("t.json: not valid JSON"));
    EXPECT_THAT(error(R"({"format": "other", "version": 1, "records": []})"), HasSubstr("shardline-gemm-tuning"));
    EXPECT_THAT(error(R"({"format": "shardline-gemm-tuning", "version": 2, "records": []})"),
                HasSubstr("expected \"version\": 1, got 2"));
    EXPECT_THAT(error(R"({"format": "shardline-gemm-tuning", "version": 1})"), HasSubstr("\"records\" array"));
    const std::string head = R"({"format": "shardline-gemm-tuning", "version": 1, "records": [)";
    EXPECT_THAT(error(head + R"({"gpu": "g", "cublaslt": 1, "algo": []}]})"), HasSubstr("record 0 has no \"key\""));
    EXPECT_THAT(error(head + R"({"gpu": "g", "cublaslt": 1, "key": "k", "algo": ["0x1"]}]})"),
                HasSubstr("array of 8 hex strings"));
    EXPECT_THAT(error(head + R"({"gpu": "g", "cublaslt": 1, "key": "k",
                                 "algo": ["0x1","0x2","0x3","0x4","0x5","0x6","0x7","zz"]}]})"),
                HasSubstr("got 'zz'"));
    EXPECT_THAT(error(head + R"({"gpu": "g", "cublaslt": 1, "key": "k", "epilogue": "maybe",
                                 "algo": ["0x1","0x2","0x3","0x4","0x5","0x6","0x7","0x8"]}]})"),
                HasSubstr("\"epilogue\" must be \"fused\" or \"separate\""));
    EXPECT_THAT(error(head + R"({"gpu": "g", "cublaslt": 1, "key": "k", "bgradb": "maybe",
                                 "algo": ["0x1","0x2","0x3","0x4","0x5","0x6","0x7","0x8"]}]})"),
                HasSubstr("\"bgradb\" must be \"fused\" or \"separate\""));
    EXPECT_EQ(error(head + R"({"gpu": "g", "cublaslt": 1, "key": "k",
                              "algo": ["0x1","0x2","0x3","0x4","0x5","0x6","0x7","0x8"]}]})"),
              "accepted");
}

// The GEMV decision of a matrix-vector product's record: "kernel" and "gemv_us", written only when the GEMV was
// chosen or timed, so that the records of other GEMMs (and files written before the GEMV) are unchanged.
TEST(GemmTuningTableTest, GemvDecisionRoundTripsAndIsWrittenOnlyWhenTimedOrChosen) {
    const auto json_of = [](const GemmTuningRecord& r) {
        GemmTuningTable table;
        table.Upsert(r);
        return table.ToJson();
    };
    GemmTuningRecord gemv = SampleRecord("tn m=1536 n=1 k=4096 epilogue=bias(bf16)", 11);
    gemv.gemv = true;
    gemv.gemv_us = 5.25;
    gemv.gemv_cublaslt_us = 6.5;
    GemmTuningRecord cublaslt = SampleRecord("tn m=4096 n=1 k=1024 epilogue=none", 12);
    cublaslt.gemv_us = 7.5;
    const GemmTuningRecord plain = SampleRecord("tn m=256 n=384 k=512 epilogue=none", 13);

    EXPECT_THAT(json_of(gemv), HasSubstr("\"kernel\": \"gemv\""));
    EXPECT_THAT(json_of(gemv), HasSubstr("\"gemv_us\": 5.25"));
    EXPECT_THAT(json_of(gemv), HasSubstr("\"gemv_cublaslt_us\": 6.5"));
    EXPECT_THAT(json_of(cublaslt), HasSubstr("\"kernel\": \"cublaslt\""));
    EXPECT_THAT(json_of(cublaslt), HasSubstr("\"gemv_us\": 7.5"));
    EXPECT_THAT(json_of(plain), Not(HasSubstr("\"kernel\"")));
    EXPECT_THAT(json_of(plain), Not(HasSubstr("gemv_us")));

    GemmTuningTable table;
    table.Upsert(gemv);
    table.Upsert(cublaslt);
    table.Upsert(plain);
    const GemmTuningTable back = GemmTuningTable::Parse(table.ToJson());
    ASSERT_EQ(back.size(), 3u);
    EXPECT_EQ(back.records()[0], gemv);
    EXPECT_EQ(back.records()[1], cublaslt);
    EXPECT_EQ(back.records()[2], plain);
    EXPECT_TRUE(back.records()[0].gemv);
    EXPECT_EQ(back.records()[0].gemv_us, 5.25);
    EXPECT_EQ(back.records()[0].gemv_cublaslt_us, 6.5);
    EXPECT_FALSE(back.records()[1].gemv);
    EXPECT_EQ(back.records()[1].gemv_us, 7.5);
}

// A record without "kernel" (every file written before the GEMV) is a cuBLASLt record; "kernel" alone, without
// "gemv_us", is a GEMV record that was not timed.
TEST(GemmTuningTableTest, RecordsWithoutAKernelRunCublasLt) {
    const std::string head = R"({"format": "shardline-gemm-tuning", "version": 1, "records": [)";
    const std::string algo = R"("algo": ["0x1","0x2","0x3","0x4","0x5","0x6","0x7","0x8"])";
    const GemmTuningTable table =
        GemmTuningTable::Parse(head + R"({"gpu": "g", "cublaslt": 1, "key": "old", )" + algo + "}, " +
                               R"({"gpu": "g", "cublaslt": 1, "key": "untimed", "kernel": "gemv", )" + algo + "}]}");
    ASSERT_EQ(table.size(), 2u);
    EXPECT_FALSE(table.records()[0].gemv);
    EXPECT_EQ(table.records()[0].gemv_us, 0.0);
    EXPECT_TRUE(table.records()[1].gemv);
    EXPECT_EQ(table.records()[1].gemv_us, 0.0);
}

TEST(GemmTuningTableTest, MalformedGemvFieldsAreRefusedNamingTheRecordAndField) {
    const auto error = ParseError;
    // The bad record is the second one: the message must say which.
    const std::string head = R"({"format": "shardline-gemm-tuning", "version": 1, "records": [{"gpu": "g",
        "cublaslt": 1, "key": "good", "algo": ["0x1","0x2","0x3","0x4","0x5","0x6","0x7","0x8"]}, )";
    const std::string algo = R"("algo": ["0x1","0x2","0x3","0x4","0x5","0x6","0x7","0x8"])";
    const std::string unknown =
        error(head + R"({"gpu": "g", "cublaslt": 1, "key": "k", "kernel": "cutlass", )" + algo + "}]}");
    EXPECT_THAT(unknown, HasSubstr("t.json: record 1"));
    EXPECT_THAT(unknown, HasSubstr("\"kernel\" must be \"gemv\" or \"cublaslt\", got \"cutlass\""));
    EXPECT_THAT(error(head + R"({"gpu": "g", "cublaslt": 1, "key": "k", "kernel": 1, )" + algo + "}]}"),
                HasSubstr("\"kernel\" must be \"gemv\" or \"cublaslt\", got 1"));
    const std::string not_a_number =
        error(head + R"({"gpu": "g", "cublaslt": 1, "key": "k", "kernel": "gemv", "gemv_us": "fast", )" + algo + "}]}");
    EXPECT_THAT(not_a_number, HasSubstr("t.json: record 1"));
    EXPECT_THAT(not_a_number, HasSubstr("\"gemv_us\" must be a number"));
}

TEST(GemmTuningTableTest, MissingFileLoadsEmptyAndSaveLoadRoundTrips) {
    TempDir dir;
    const std::string path = dir.File("tuning.json");
    EXPECT_EQ(GemmTuningTable::Load(path).size(), 0u);
    GemmTuningTable table;
    table.Upsert(SampleRecord("a", 1));
    table.Save(path);
    const GemmTuningTable back = GemmTuningTable::Load(path);
    ASSERT_EQ(back.size(), 1u);
    EXPECT_EQ(back.records()[0], table.records()[0]);
    // No temporary file is left beside it.
    std::size_t files = 0;
    for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(path).parent_path())) {
        (void)entry;
        ++files;
    }
    EXPECT_EQ(files, 1u);
}

TEST(GemmTuningTableTest, SaveMergesRecordsAnotherProcessWroteAndOursWin) {
    TempDir dir;
    const std::string path = dir.File("tuning.json");
    GemmTuningTable theirs;
    theirs.Upsert(SampleRecord("theirs", 1));
    theirs.Upsert(SampleRecord("both", 2));
    theirs.Save(path);
    GemmTuningTable ours;
    ours.Upsert(SampleRecord("both", 3));
    ours.Upsert(SampleRecord("ours", 4));
    ours.Save(path);
    const GemmTuningTable merged = GemmTuningTable::Load(path);
    EXPECT_EQ(merged.size(), 3u);
    EXPECT_EQ(merged.Find("NVIDIA H100 80GB HBM3", 130100, "theirs")->algo[0], 1u);
    EXPECT_EQ(merged.Find("NVIDIA H100 80GB HBM3", 130100, "both")->algo[0], 3u);
    EXPECT_EQ(merged.Find("NVIDIA H100 80GB HBM3", 130100, "ours")->algo[0], 4u);
}

TEST(GemmTuningTableTest, SaveReplacesADamagedFile) {
    TempDir dir;
    const std::string path = dir.File("tuning.json");
    WriteFile(path, "not json");
    EXPECT_THROW((void)GemmTuningTable::Load(path), Error);
    GemmTuningTable table;
    table.Upsert(SampleRecord("a", 1));
    table.Save(path);
    EXPECT_EQ(GemmTuningTable::Load(path).size(), 1u);
}

TEST(GemmTuningTableTest, SaveIntoAMissingDirectoryThrowsNamingThePath) {
    TempDir dir;
    const std::string path = dir.File("no/such/dir/tuning.json");
    GemmTuningTable table;
    table.Upsert(SampleRecord("a", 1));
    try {
        table.Save(path);
        FAIL() << "saved into a missing directory";
    } catch (const Error& e) {
        EXPECT_THAT(std::string(e.what()), HasSubstr(path));
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Options

TEST(GemmTuningOptionsTest, DefaultsAreTuningOnTop8NoFile) {
    ScopedEnv a("SHARDLINE_GEMM_TUNING", std::nullopt);
    ScopedEnv b("SHARDLINE_GEMM_TUNING_TOP_K", std::nullopt);
    ScopedEnv c("SHARDLINE_GEMM_TUNING_FILE", std::nullopt);
    const GemmTuningOptions o = GemmTuningOptionsFromEnv();
    EXPECT_TRUE(o.enabled);
    EXPECT_EQ(o.top_k, 8);
    EXPECT_EQ(o.file, "");
}

TEST(GemmTuningOptionsTest, EnvironmentSetsEachOption) {
    ScopedEnv a("SHARDLINE_GEMM_TUNING", "0");
    ScopedEnv b("SHARDLINE_GEMM_TUNING_TOP_K", "16");
    ScopedEnv c("SHARDLINE_GEMM_TUNING_FILE", "/tmp/x.json");
    const GemmTuningOptions o = GemmTuningOptionsFromEnv();
    EXPECT_FALSE(o.enabled);
    EXPECT_EQ(o.top_k, 16);
    EXPECT_EQ(o.file, "/tmp/x.json");
}

TEST(GemmTuningOptionsTest, MalformedValuesNameTheVariable) {
    {
        ScopedEnv a("SHARDLINE_GEMM_TUNING", "sometimes");
        try {
            (void)GemmTuningOptionsFromEnv();
            FAIL() << "accepted SHARDLINE_GEMM_TUNING=sometimes";
        } catch (const Error& e) {
            EXPECT_THAT(std::string(e.what()), HasSubstr("SHARDLINE_GEMM_TUNING"));
            EXPECT_THAT(std::string(e.what()), HasSubstr("'sometimes'"));
        }
    }
    for (const char* bad : {"0", "65", "8x", "-1"}) {
        ScopedEnv b("SHARDLINE_GEMM_TUNING_TOP_K", bad);
        try {
            (void)GemmTuningOptionsFromEnv();
            FAIL() << "accepted SHARDLINE_GEMM_TUNING_TOP_K=" << bad;
        } catch (const Error& e) {
            EXPECT_THAT(std::string(e.what()), HasSubstr("SHARDLINE_GEMM_TUNING_TOP_K"));
        }
    }
}

TEST(GemmTuningOptionsTest, GemvModeComesFromTheEnvironmentAndDefaultsToAuto) {
    {
        ScopedEnv unset("SHARDLINE_GEMM_GEMV", std::nullopt);
        EXPECT_EQ(GemmTuningOptionsFromEnv().gemv, GemmGemv::kAuto);
        EXPECT_EQ(GemmTuningOptions{}.gemv, GemmGemv::kAuto);
    }
    {
        ScopedEnv off("SHARDLINE_GEMM_GEMV", "off");
        EXPECT_EQ(GemmTuningOptionsFromEnv().gemv, GemmGemv::kOff);
    }
    {
        ScopedEnv always("SHARDLINE_GEMM_GEMV", "always");
        EXPECT_EQ(GemmTuningOptionsFromEnv().gemv, GemmGemv::kAlways);
    }
    {
        ScopedEnv auto_mode("SHARDLINE_GEMM_GEMV", "auto");
        EXPECT_EQ(GemmTuningOptionsFromEnv().gemv, GemmGemv::kAuto);
    }
    ScopedEnv bad("SHARDLINE_GEMM_GEMV", "sometimes");
    try {
        (void)GemmTuningOptionsFromEnv();
        FAIL() << "accepted SHARDLINE_GEMM_GEMV=sometimes";
    } catch (const Error& e) {
        EXPECT_THAT(std::string(e.what()), HasSubstr("SHARDLINE_GEMM_GEMV"));
        EXPECT_THAT(std::string(e.what()), HasSubstr("'sometimes'"));
    }
}

// The GEMV mode is an option like the others: SetGemmTuningOptions replaces it, and a pause (which stops the timing)
// leaves it alone.
TEST(GemmTuningOptionsTest, SetOptionsSetsTheGemvModeAndAPauseKeepsIt) {
    const GemmTuningOptions saved = CurrentGemmTuningOptions();
    SetGemmTuningOptions(GemmTuningOptions{.enabled = true, .top_k = 8, .gemv = GemmGemv::kAlways});
    EXPECT_EQ(CurrentGemmTuningOptions().gemv, GemmGemv::kAlways);
    {
        const GemmTuningPause pause;
        EXPECT_FALSE(CurrentGemmTuningOptions().enabled);
        EXPECT_EQ(CurrentGemmTuningOptions().gemv, GemmGemv::kAlways);
    }
    SetGemmTuningOptions(GemmTuningOptions{.gemv = GemmGemv::kOff});
    EXPECT_EQ(CurrentGemmTuningOptions().gemv, GemmGemv::kOff);
    SetGemmTuningOptions(saved);
    EXPECT_EQ(CurrentGemmTuningOptions().gemv, saved.gemv);
}

TEST(GemmTuningOptionsTest, SetOptionsReplacesTheEnvironmentsAndChecksTopK) {
    const GemmTuningOptions saved = CurrentGemmTuningOptions();
    SetGemmTuningOptions(GemmTuningOptions{.enabled = false, .top_k = 3, .file = "f.json"});
    EXPECT_FALSE(CurrentGemmTuningOptions().enabled);
    EXPECT_EQ(CurrentGemmTuningOptions().top_k, 3);
    EXPECT_EQ(CurrentGemmTuningOptions().file, "f.json");
    EXPECT_THROW(SetGemmTuningOptions(GemmTuningOptions{.top_k = 0}), Error);
    SetGemmTuningOptions(saved);
    EXPECT_EQ(CurrentGemmTuningOptions().top_k, saved.top_k);
}

TEST(GemmTuningOptionsTest, APauseTurnsTimingOffOnItsThreadOnlyAndNests) {
    const GemmTuningOptions saved = CurrentGemmTuningOptions();
    SetGemmTuningOptions(GemmTuningOptions{.enabled = true, .top_k = 5});
    {
        const GemmTuningPause outer;
        EXPECT_FALSE(CurrentGemmTuningOptions().enabled);
        EXPECT_EQ(CurrentGemmTuningOptions().top_k, 5) << "only the timing pauses";
        bool other_thread = false;
        std::thread([&] { other_thread = CurrentGemmTuningOptions().enabled; }).join();
        EXPECT_TRUE(other_thread) << "another thread still tunes";
        {
            const GemmTuningPause inner;
            EXPECT_FALSE(CurrentGemmTuningOptions().enabled);
        }
        EXPECT_FALSE(CurrentGemmTuningOptions().enabled) << "the outer pause still holds";
    }
    EXPECT_TRUE(CurrentGemmTuningOptions().enabled);
    SetGemmTuningOptions(saved);
}

} // namespace
} // namespace shardline::kernels
