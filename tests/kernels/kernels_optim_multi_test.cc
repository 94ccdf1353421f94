// SgdStepMulti and AdamWStepMulti on every device: bit for bit the single-tensor op run on each entry in turn (sizes
// 1, 3, 1000003 and chunk edges, misaligned params and model copies, mixed model dtypes and none, differing step
// counts, more tensors and chunks than one CUDA launch takes), against torch's formulas in float64 from random states,
// and their error messages.

#include <cstdint>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/kernels/optim.h>

#include "helpers.h"
#include "optim_reference.h"

namespace shardline::testing {
namespace {

using kernels::AdamWStep;
using kernels::AdamWStepArgs;
using kernels::AdamWStepMulti;
using kernels::AdamWStepTensor;
using kernels::SgdStep;
using kernels::SgdStepArgs;
using kernels::SgdStepMulti;
using kernels::SgdStepTensor;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kRounds = 3;
// CUDA packs up to 110 tensors and 2560 chunks of 65536 elements into one launch (multi_tensor_apply.cuh); the
// Multi args may lower both limits, which the launch-spanning test does to keep its tensors small.
constexpr std::int64_t kChunk = 65536;

/// Launch limits passed to the Multi ops (0: the kernel's own).
struct Limits {
    int tensors = 0;
    int chunks = 0;
};

/// One entry of a case: its size, where its tensors sit, its model copy and its step count in the first round.
struct EntrySpec {
    std::int64_t n = 1;
    bool misaligned_param = false; ///< the master one element off the 16-byte grid (CUDA: scalars for this tensor)
    bool misaligned_model = false; ///< the model copy one element off
    int model = 0;                 ///< 0: none; k: the k-th of the case's model dtypes (cycled)
    std::int64_t step = 1;         ///< AdamW's t (SGD: 1 is the first step, buf = g)
};

/// The tensors of one entry, made from the entry's index alone: two calls give the same values.
struct Entry {
    MisalignedTensor param;
    MisalignedTensor state0; ///< exp_avg / momentum_buffer
    MisalignedTensor state1; ///< exp_avg_sq
    MisalignedTensor model;
    bool has_model = false;
    std::int64_t step = 1;
};

/// Whether two tensors hold the same bytes; names the first differing byte otherwise.
::testing::AssertionResult SameBits(const Tensor &a, const Tensor &b) {
    const std::vector<unsigned char> x = HostBytes(a);
    const std::vector<unsigned char> y = HostBytes(b);
    if (x.size() != y.size()) {
        return ::testing::AssertionFailure() << "sizes " << x.size() << " and " << y.size();
    }
    for (std::size_t i = 0; i < x.size(); ++i) {
        if (x[i] != y[i]) {
            return ::testing::AssertionFailure() << "byte " << i << " of " << x.size() << " differs";
        }
    }
    return ::testing::AssertionSuccess();
}

class OptimMultiTest : public DeviceTest<> {
protected:
    DType master_dtype() const { return device().is_cuda() ? DType::kFloat32 : dtype(); }
    /// The model dtypes entries cycle through, starting at the case's dtype.
    DType model_dtype(int k) const {
        const std::vector<DType> all = KernelDTypes(device().type);
        std::size_t first = 0;
        while (all[first] != dtype()) {
            ++first;
        }
        return all[(first + static_cast<std::size_t>(k) - 1) % all.size()];
    }
    Tensor Uniform(std::int64_t n, std::uint64_t seed, std::string_view name, double lo, double hi) const {
        return RandomTensor({n}, master_dtype(), device(), seed, name, RandomDistribution::kUniform, lo, hi);
    }
    /// Random master, moments (v > 0) and a poisoned model copy.
    Entry Make(const EntrySpec &s, std::size_t index) const {
        const auto seed = static_cast<std::uint64_t>(1000 + index);
        Entry e;
        e.param = Place(Random({s.n}, master_dtype(), seed, "param"), s.misaligned_param);
        e.state0 = Place(Random({s.n}, master_dtype(), seed, "state0", 0.1), s.misaligned_param);
        e.state1 = Place(Uniform(s.n, seed, "state1", 1e-4, 1.0), s.misaligned_param);
        e.has_model = s.model > 0;
        if (e.has_model) {
            e.model = Place(Poison({s.n}, model_dtype(s.model)), s.misaligned_model);
        }
        e.step = s.step;
        return e;
    }
    std::vector<Entry> MakeAll(const std::vector<EntrySpec> &specs) const {
        std::vector<Entry> entries;
        for (std::size_t i = 0; i < specs.size(); ++i) {
            entries.push_back(Make(specs[i], i));
        }
        return entries;
    }
    /// Round r's gradient of entry i (misaligned with its master).
    MisalignedTensor Grad(const EntrySpec &s, std::size_t i, int round) const {
        return Place(Random({s.n}, master_dtype(), static_cast<std::uint64_t>(5000 + 31 * i + round), "grad"),
                     s.misaligned_param);
    }

    static std::vector<AdamWStepTensor> AdamWTensors(std::vector<Entry> &entries,
                                                     const std::vector<MisalignedTensor> &grads) {
        std::vector<AdamWStepTensor> tensors;
        for (std::size_t i = 0; i < entries.size(); ++i) {
            Entry &e = entries[i];
            tensors.push_back({.param = e.param.view,
                               .grad = grads[i].view,
                               .exp_avg = e.state0.view,
                               .exp_avg_sq = e.state1.view,
                               .step = e.step,
                               .model_param = e.has_model ? &e.model.view : nullptr});
        }
        return tensors;
    }
    static std::vector<SgdStepTensor> SgdTensors(std::vector<Entry> &entries,
                                                 const std::vector<MisalignedTensor> &grads, bool momentum) {
        std::vector<SgdStepTensor> tensors;
        for (std::size_t i = 0; i < entries.size(); ++i) {
            Entry &e = entries[i];
            tensors.push_back({.param = e.param.view,
                               .grad = grads[i].view,
                               .momentum_buffer = momentum ? &e.state0.view : nullptr,
                               .first_step = e.step == 1,
                               .model_param = e.has_model ? &e.model.view : nullptr});
        }
        return tensors;
    }

    void ExpectSameBits(const std::vector<Entry> &multi, const std::vector<Entry> &single, int round) const {
        for (std::size_t i = 0; i < multi.size(); ++i) {
            SCOPED_TRACE(::testing::Message() << "round " << round << ", tensors[" << i << "]");
            EXPECT_TRUE(SameBits(multi[i].param.view, single[i].param.view)) << "param";
            EXPECT_TRUE(SameBits(multi[i].state0.view, single[i].state0.view)) << "state0";
            EXPECT_TRUE(SameBits(multi[i].state1.view, single[i].state1.view)) << "state1";
            if (multi[i].has_model) {
                EXPECT_TRUE(SameBits(multi[i].model.view, single[i].model.view)) << "model_param";
                // And the copy is the updated master rounded once.
                EXPECT_EQ(multi[i].model.view.ToDoubleVector(),
                          RoundTo(multi[i].param.view.ToDoubleVector(), multi[i].model.view.dtype()));
            }
        }
    }

    /// kRounds AdamW steps of `specs` through AdamWStepMulti and through AdamWStep per entry: the same bits, and
    /// (when `reference`) each round's multi result against the float64 formula from the state before it.
    void RunAdamW(const std::vector<EntrySpec> &specs, const AdamWConfig &c, bool reference, Limits limits = {}) const {
        std::vector<Entry> multi = MakeAll(specs);
        std::vector<Entry> single = MakeAll(specs);
        for (int round = 0; round < kRounds; ++round) {
            std::vector<MisalignedTensor> grads;
            for (std::size_t i = 0; i < specs.size(); ++i) {
                grads.push_back(Grad(specs[i], i, round));
            }
            std::vector<Values> p;
            std::vector<Values> m;
            std::vector<Values> v;
            if (reference) {
                for (const Entry &e : multi) {
                    p.push_back(e.param.view.ToDoubleVector());
                    m.push_back(e.state0.view.ToDoubleVector());
                    v.push_back(e.state1.view.ToDoubleVector());
                    ASSERT_TRUE(p.back().empty() || AbsSum(p.back()) > 0.0);
                }
            }
            const std::vector<AdamWStepTensor> tensors = AdamWTensors(multi, grads);
            AdamWStepMulti({.tensors = tensors,
                            .lr = c.lr,
                            .beta1 = c.beta1,
                            .beta2 = c.beta2,
                            .eps = c.eps,
                            .weight_decay = c.weight_decay,
                            .max_tensors_per_launch = limits.tensors,
                            .max_chunks_per_launch = limits.chunks});
            for (const AdamWStepTensor &t : AdamWTensors(single, grads)) {
                AdamWStep({.param = t.param,
                           .grad = t.grad,
                           .exp_avg = t.exp_avg,
                           .exp_avg_sq = t.exp_avg_sq,
                           .lr = c.lr,
                           .beta1 = c.beta1,
                           .beta2 = c.beta2,
                           .eps = c.eps,
                           .weight_decay = c.weight_decay,
                           .step = t.step,
                           .model_param = t.model_param});
            }
            ExpectSameBits(multi, single, round);
            for (std::size_t i = 0; reference && i < multi.size(); ++i) {
                RefAdamWStep(p[i], m[i], v[i], grads[i].view.ToDoubleVector(), c, multi[i].step);
                EXPECT_TRUE(ValuesMatch(multi[i].param.view, p[i], master_dtype(), 2)) << "param " << i;
                EXPECT_TRUE(ValuesMatch(multi[i].state0.view, m[i], master_dtype())) << "exp_avg " << i;
                EXPECT_TRUE(ValuesMatch(multi[i].state1.view, v[i], master_dtype())) << "exp_avg_sq " << i;
            }
            for (std::size_t i = 0; i < specs.size(); ++i) {
                ++multi[i].step;
                ++single[i].step;
            }
        }
    }

    /// As RunAdamW for SGD (entries whose spec step is 1 start their momentum buffer in round 0).
    void RunSgd(const std::vector<EntrySpec> &specs, const SgdConfig &c, bool reference, Limits limits = {}) const {
        std::vector<Entry> multi = MakeAll(specs);
        std::vector<Entry> single = MakeAll(specs);
        const bool momentum = c.momentum != 0;
        for (int round = 0; round < kRounds; ++round) {
            std::vector<MisalignedTensor> grads;
            for (std::size_t i = 0; i < specs.size(); ++i) {
                grads.push_back(Grad(specs[i], i, round));
            }
            std::vector<Values> p;
            std::vector<Values> b;
            for (std::size_t i = 0; reference && i < multi.size(); ++i) {
                p.push_back(multi[i].param.view.ToDoubleVector());
                b.push_back(multi[i].state0.view.ToDoubleVector());
            }
            const std::vector<SgdStepTensor> tensors = SgdTensors(multi, grads, momentum);
            SgdStepMulti({.tensors = tensors,
                          .lr = c.lr,
                          .momentum = c.momentum,
                          .dampening = c.dampening,
                          .weight_decay = c.weight_decay,
                          .nesterov = c.nesterov,
                          .max_tensors_per_launch = limits.tensors,
                          .max_chunks_per_launch = limits.chunks});
            for (const SgdStepTensor &t : SgdTensors(single, grads, momentum)) {
                SgdStep({.param = t.param,
                         .grad = t.grad,
                         .momentum_buffer = t.momentum_buffer,
                         .lr = c.lr,
                         .momentum = c.momentum,
                         .dampening = c.dampening,
                         .weight_decay = c.weight_decay,
                         .nesterov = c.nesterov,
                         .first_step = t.first_step,
                         .model_param = t.model_param});
            }
            ExpectSameBits(multi, single, round);
            for (std::size_t i = 0; reference && i < multi.size(); ++i) {
                RefSgdStep(p[i], b[i], grads[i].view.ToDoubleVector(), c, multi[i].step == 1);
                EXPECT_TRUE(ValuesMatch(multi[i].param.view, p[i], master_dtype(), 2)) << "param " << i;
                if (momentum) {
                    EXPECT_TRUE(ValuesMatch(multi[i].state0.view, b[i], master_dtype())) << "buffer " << i;
                }
            }
            for (std::size_t i = 0; i < specs.size(); ++i) {
                ++multi[i].step;
                ++single[i].step;
            }
        }
    }
};

/// Odd sizes and chunk edges, aligned and misaligned, every model dtype and none, steps from 1 to 1000.
std::vector<EntrySpec> OddSizes() {
    return {{.n = 1, .model = 1, .step = 1},
            {.n = 3, .misaligned_param = true, .model = 2, .step = 7},
            {.n = 1000003, .model = 3, .step = 2},
            {.n = 4, .step = 1},
            {.n = kChunk, .misaligned_model = true, .model = 1, .step = 1000},
            {.n = kChunk + 1, .misaligned_param = true, .misaligned_model = true, .model = 2, .step = 3},
            {.n = 2 * kChunk + 7, .model = 1, .step = 1},
            {.n = 129, .model = 3, .step = 50}};
}

TEST_P(OptimMultiTest, AdamWMatchesThePerTensorOpBitwiseAndTorch) {
    RunAdamW(OddSizes(), {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01}, true);
    RunAdamW(OddSizes(), {.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-3, .weight_decay = 0.5}, true);
}

TEST_P(OptimMultiTest, SgdMatchesThePerTensorOpBitwiseAndTorch) {
    const std::vector<SgdConfig> configs = {
        {.lr = 0.1, .momentum = 0, .dampening = 0, .weight_decay = 0, .nesterov = false},
        {.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01, .nesterov = false},
        {.lr = 0.02, .momentum = 0.8, .dampening = 0, .weight_decay = 0.1, .nesterov = true},
    };
    for (const SgdConfig &c : configs) {
        SCOPED_TRACE(::testing::Message() << "momentum " << c.momentum << " nesterov " << c.nesterov);
        RunSgd(OddSizes(), c, true);
    }
}

TEST_P(OptimMultiTest, ManyTensorsAndChunksSpanSeveralLaunches) {
    // 102 entries whose model copies cycle through none and every dtype; CUDA launches each dtype group apart. With
    // launches of at most 36 tensors and 320 chunks (torch's table), in the float32 case on CUDA: the bf16 group holds
    // one small tensor, one of 201 chunks and one of 151, whose 118th chunk fills the launch's 320 blocks (it continues
    // in the next launch); the group of float32 copies and none holds 51 small tensors, so its table of 36 tensors
    // fills. Then the same list with the kernel's own limits (110 tensors, 2560 chunks: one launch per group). The
    // CPU provider has no launches: it runs the same list on smaller tensors, and so do the other CUDA cases.
    const bool launches = device().is_cuda() && dtype() == DType::kFloat32;
    std::vector<EntrySpec> specs;
    for (int i = 0; i < 102; ++i) {
        specs.push_back({.n = 1 + (37 * i) % 3001, .misaligned_param = i % 7 == 3, .model = i % 4, .step = 1 + i % 5});
    }
    specs[5] = {.n = launches ? 200 * kChunk + 3 : 3 * kChunk + 3, .model = 3, .step = 2};
    specs[6] = {.n = launches ? 150 * kChunk + 1 : 2 * kChunk + 1, .model = 3, .step = 1};
    for (const Limits limits : {Limits{.tensors = 36, .chunks = 320}, Limits{}}) {
        SCOPED_TRACE(::testing::Message() << "limits " << limits.tensors << " tensors, " << limits.chunks << " chunks");
        RunAdamW(specs, {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01}, false, limits);
        RunSgd(specs, {.lr = 0.05, .momentum = 0.9, .dampening = 0, .weight_decay = 0.01, .nesterov = true}, false,
               limits);
    }
}

TEST_P(OptimMultiTest, OneChunkPerLaunchGivesTheSameBits) {
    // The smallest launches: one tensor and one chunk each. The values never depend on how the list is cut.
    std::vector<EntrySpec> specs = OddSizes();
    specs.push_back({.n = 3 * kChunk + 5, .model = 1, .step = 4});
    RunAdamW(specs, {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01}, false,
             {.tensors = 1, .chunks = 1});
    RunSgd(specs, {.lr = 0.05, .momentum = 0.9, .dampening = 0, .weight_decay = 0.01, .nesterov = false}, false,
           {.tensors = 1, .chunks = 1});
}

TEST_P(OptimMultiTest, AlignedAndMisalignedTensorsGetTheSameBits) {
    // CUDA's 16-byte and scalar paths run one device function per element: the placement changes no bit.
    const std::vector<EntrySpec> aligned = {{.n = 1000003, .model = 1, .step = 3}, {.n = 4099, .model = 2, .step = 1}};
    std::vector<EntrySpec> misaligned = aligned;
    misaligned[0].misaligned_param = true;
    misaligned[1].misaligned_model = true;
    std::vector<Entry> a = MakeAll(aligned);
    std::vector<Entry> b = MakeAll(misaligned);
    std::vector<MisalignedTensor> ga;
    std::vector<MisalignedTensor> gb;
    for (std::size_t i = 0; i < aligned.size(); ++i) {
        ga.push_back(Grad(aligned[i], i, 0));
        gb.push_back(Grad(misaligned[i], i, 0));
    }
    const std::vector<AdamWStepTensor> ta = AdamWTensors(a, ga);
    const std::vector<AdamWStepTensor> tb = AdamWTensors(b, gb);
    AdamWStepMulti({.tensors = ta});
    AdamWStepMulti({.tensors = tb});
    ExpectSameBits(a, b, 0);
}

TEST_P(OptimMultiTest, EmptyEntriesAreSkipped) {
    const std::vector<EntrySpec> specs = {{.n = 0, .model = 1}, {.n = 5, .model = 1, .step = 2}, {.n = 0}};
    RunAdamW(specs, {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01}, true);
    RunSgd(specs, {.lr = 0.1, .momentum = 0.5, .dampening = 0, .weight_decay = 0, .nesterov = false}, true);
    // A list of empty entries only: nothing to launch.
    std::vector<Entry> empty = MakeAll({{.n = 0}, {.n = 0, .model = 1}});
    const std::vector<MisalignedTensor> grads = {Grad({.n = 0}, 0, 0), Grad({.n = 0}, 1, 0)};
    const std::vector<AdamWStepTensor> tensors = AdamWTensors(empty, grads);
    AdamWStepMulti({.tensors = tensors});
    EXPECT_EQ(empty[0].param.view.numel(), 0);
}

SHARDLINE_INSTANTIATE_DEVICE_TEST_SUITE_P(OptimMultiTest, DeviceCases, DeviceDTypeName);

// ---------------------------------------------------------------------------------------------------------------------
// Errors (the CPU's messages; the device check on CUDA)

/// Entries of float32 [4] tensors, with room to break one.
struct ErrorCase {
    std::vector<Tensor> param, grad, m, v;
    explicit ErrorCase(std::size_t n) {
        for (std::size_t i = 0; i < n; ++i) {
            param.push_back(RandomTensor({4}, DType::kFloat32, Device::CPU(), 60 + i, "param"));
            grad.push_back(RandomTensor({4}, DType::kFloat32, Device::CPU(), 60 + i, "grad"));
            m.push_back(Tensor::Zeros({4}, DType::kFloat32));
            v.push_back(Tensor::Zeros({4}, DType::kFloat32));
        }
    }
    std::vector<AdamWStepTensor> AdamW() {
        std::vector<AdamWStepTensor> t;
        for (std::size_t i = 0; i < param.size(); ++i) {
            t.push_back({.param = param[i], .grad = grad[i], .exp_avg = m[i], .exp_avg_sq = v[i]});
        }
        return t;
    }
    std::vector<SgdStepTensor> Sgd() {
        std::vector<SgdStepTensor> t;
        for (std::size_t i = 0; i < param.size(); ++i) {
            t.push_back({.param = param[i], .grad = grad[i], .momentum_buffer = &m[i]});
        }
        return t;
    }
};

TEST(OptimMultiErrorsTest, AnEmptyListIsAnError) {
    EXPECT_THAT(MessageOf<Error>([] { AdamWStepMulti({}); }),
                AllOf(HasSubstr("AdamWStepMulti: tensors must hold at least one entry, got an empty list")));
    EXPECT_THAT(MessageOf<Error>([] { SgdStepMulti({.lr = 0.1}); }),
                AllOf(HasSubstr("SgdStepMulti: tensors must hold at least one entry, got an empty list")));
}

TEST(OptimMultiErrorsTest, AnEntrysMismatchNamesTheEntryAndNothingIsUpdated) {
    ErrorCase c(3);
    const Values before = c.param[0].ToDoubleVector();
    c.v[1] = Tensor::Zeros({5}, DType::kFloat32);
    EXPECT_THAT(MessageOf<ShapeError>([&] { AdamWStepMulti({.tensors = c.AdamW()}); }),
                AllOf(HasSubstr("AdamWStepMulti"), HasSubstr("tensors[1].exp_avg_sq must have shape [4]"),
                      HasSubstr("Tensor[5]")));
    EXPECT_EQ(c.param[0].ToDoubleVector(), before) << "entry 0 was updated before entry 1's check";
    c.v[1] = Tensor::Zeros({4}, DType::kFloat32);
    c.grad[2] = Tensor::Zeros({4}, DType::kFloat64);
    EXPECT_THAT(MessageOf<DTypeError>([&] { AdamWStepMulti({.tensors = c.AdamW()}); }),
                AllOf(HasSubstr("AdamWStepMulti"),
                      HasSubstr("tensors[2].grad and tensors[2].param must have one dtype"),
                      HasSubstr("Tensor[4] float64 cpu")));
    EXPECT_THAT(
        MessageOf<DTypeError>([&] { SgdStepMulti({.tensors = c.Sgd(), .lr = 0.1}); }),
        AllOf(HasSubstr("SgdStepMulti"), HasSubstr("tensors[2].grad and tensors[2].param must have one dtype")));
    EXPECT_EQ(c.param[0].ToDoubleVector(), before);
}

TEST(OptimMultiErrorsTest, StepsAndHyperParametersFollowTheSingleTensorChecks) {
    ErrorCase c(2);
    std::vector<AdamWStepTensor> step0 = c.AdamW();
    step0[1].step = 0;
    EXPECT_THAT(MessageOf<Error>([&] { AdamWStepMulti({.tensors = step0}); }),
                AllOf(HasSubstr("AdamWStepMulti"), HasSubstr("tensors[1].step must be >= 1"), HasSubstr("got 0")));
    EXPECT_THAT(MessageOf<Error>([&] { AdamWStepMulti({.tensors = c.AdamW(), .beta1 = 1.0}); }),
                AllOf(HasSubstr("AdamWStepMulti"), HasSubstr("beta1 must be in [0, 1), got 1")));
    std::vector<SgdStepTensor> no_buffer = c.Sgd();
    no_buffer[1].momentum_buffer = nullptr;
    EXPECT_THAT(MessageOf<Error>([&] { SgdStepMulti({.tensors = no_buffer, .lr = 0.1, .momentum = 0.9}); }),
                AllOf(HasSubstr("SgdStepMulti"), HasSubstr("momentum 0.9 needs a tensors[1].momentum_buffer")));
    EXPECT_THAT(MessageOf<Error>(
                    [&] { SgdStepMulti({.tensors = c.Sgd(), .momentum = 0.9, .dampening = 0.1, .nesterov = true}); }),
                AllOf(HasSubstr("SgdStepMulti"), HasSubstr("nesterov needs momentum > 0 and dampening == 0")));
    Tensor model3 = Tensor::Zeros({3}, DType::kFloat64);
    std::vector<AdamWStepTensor> bad_model = c.AdamW();
    bad_model[0].model_param = &model3;
    EXPECT_THAT(MessageOf<ShapeError>([&] { AdamWStepMulti({.tensors = bad_model}); }),
                AllOf(HasSubstr("AdamWStepMulti"), HasSubstr("tensors[0].model_param must have shape [4]")));
}

TEST(OptimMultiErrorsTest, EntriesMustNotShareMemory) {
    {
        // The same master twice: updated in parallel it would get one step, entry after entry two.
        ErrorCase c(2);
        c.param[1] = c.param[0];
        EXPECT_THAT(MessageOf<Error>([&] { AdamWStepMulti({.tensors = c.AdamW()}); }),
                    AllOf(HasSubstr("AdamWStepMulti"), HasSubstr("tensors[0].param"), HasSubstr("tensors[1].param"),
                          HasSubstr("share memory; the entries must not overlap")));
    }
    {
        // Partly overlapping views of one buffer: entry 0's exp_avg [0, 4) and entry 1's exp_avg_sq [2, 6).
        ErrorCase c(2);
        Tensor buffer = Tensor::Zeros({8}, DType::kFloat32);
        c.m[0] = Tensor::FromBlob(buffer.data(), {4}, DType::kFloat32, Device::CPU());
        c.v[1] = Tensor::FromBlob(static_cast<float *>(buffer.data()) + 2, {4}, DType::kFloat32, Device::CPU());
        EXPECT_THAT(
            MessageOf<Error>([&] { AdamWStepMulti({.tensors = c.AdamW()}); }),
            AllOf(HasSubstr("tensors[0].exp_avg"), HasSubstr("tensors[1].exp_avg_sq"), HasSubstr("share memory")));
    }
    ErrorCase c(2);
    std::vector<SgdStepTensor> shared = c.Sgd();
    shared[1].model_param = &c.m[0];
    EXPECT_THAT(MessageOf<Error>([&] { SgdStepMulti({.tensors = shared, .lr = 0.1, .momentum = 0.9}); }),
                AllOf(HasSubstr("SgdStepMulti"), HasSubstr("tensors[0].momentum_buffer"),
                      HasSubstr("tensors[1].model_param"), HasSubstr("share memory")));
    // Within one entry the single-tensor op's rules hold: a float32 model copy may be the master itself.
    std::vector<SgdStepTensor> own = c.Sgd();
    own[0].model_param = &c.param[0];
    const Values before = c.param[0].ToDoubleVector();
    SgdStepMulti({.tensors = own, .lr = 0.1, .momentum = 0.9});
    EXPECT_NE(c.param[0].ToDoubleVector(), before);
}

TEST_F(CudaTest, OptimMultiEntriesMustShareOneDevice) {
    Tensor param = Tensor::Zeros({4}, DType::kFloat32);
    const Tensor grad = Tensor::Zeros({4}, DType::kFloat32);
    Tensor gparam = Tensor::Zeros({4}, DType::kFloat32, Gpu());
    const Tensor ggrad = Tensor::Zeros({4}, DType::kFloat32, Gpu());
    const std::vector<SgdStepTensor> s = {{.param = param, .grad = grad}, {.param = gparam, .grad = ggrad}};
    EXPECT_THAT(MessageOf<DeviceError>([&] { SgdStepMulti({.tensors = s, .lr = 0.1}); }),
                AllOf(HasSubstr("SgdStepMulti"),
                      HasSubstr("tensors[1].param and tensors[0].param must be on one device"), HasSubstr("cuda:0")));
}

} // namespace
} // namespace shardline::testing
