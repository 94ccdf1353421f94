#include "agree.h"

#include <cstdint>
#include <utility>

#include <shardline/core/error.h>
#include <shardline/core/tensor.h>

namespace shardline::ckpt::detail {
namespace {

std::vector<double> AllReduce(comm::Communicator *world, std::vector<double> values, comm::ReduceOp op) {
    if (world == nullptr || world->size() == 1 || values.empty()) {
        return values;
    }
    const std::int64_t n = static_cast<std::int64_t>(values.size());
    Tensor t = Tensor::FromVector(values, {n}, DType::kFloat64).To(world->device());
    world->AllReduce(t, op)->Wait(/*host=*/true);
    return t.ToDoubleVector();
}

} // namespace

std::vector<double> AllReduceSum(comm::Communicator *world, std::vector<double> values) {
    return AllReduce(world, std::move(values), comm::ReduceOp::kSum);
}

std::vector<double> AllReduceMax(comm::Communicator *world, std::vector<double> values) {
    return AllReduce(world, std::move(values), comm::ReduceOp::kMax);
}

void AgreeOrThrow(comm::Communicator *world, const std::string &op, const std::string &error) {
    if (world == nullptr || world->size() == 1) {
        if (!error.empty()) {
            throw Error(error);
        }
        return;
    }
    const int size = world->size();
    const int rank = world->rank();
    // Max of (size - rank) picks the lowest failing rank; the sum counts the failures.
    const std::vector<double> flags =
        AllReduce(world, {error.empty() ? 0.0 : static_cast<double>(size - rank)}, comm::ReduceOp::kMax);
    if (flags[0] == 0.0) {
        return;
    }
    const int failing = size - static_cast<int>(flags[0]);
    const double failures = AllReduce(world, {error.empty() ? 0.0 : 1.0}, comm::ReduceOp::kSum)[0];
    // The failing rank's message, to every rank: its length, then its bytes as float64.
    std::vector<double> length{rank == failing ? static_cast<double>(error.size()) : 0.0};
    length = AllReduce(world, length, comm::ReduceOp::kMax);
    std::vector<double> bytes(static_cast<std::size_t>(length[0]), 0.0);
    if (rank == failing) {
        for (std::size_t i = 0; i < error.size(); ++i) {
            bytes[i] = static_cast<double>(static_cast<unsigned char>(error[i]));
        }
    }
    bytes = AllReduce(world, std::move(bytes), comm::ReduceOp::kSum);
    std::string message;
    message.reserve(bytes.size());
    for (double b : bytes) {
        message.push_back(static_cast<char>(static_cast<unsigned char>(b)));
    }
    const std::string others =
        failures > 1 ? fmt::format(" ({} ranks failed)", static_cast<int>(failures)) : std::string();
    if (rank == failing) {
        throw Error(message + others);
    }
    throw Error(fmt::format("{}: failed on rank {}{}: {}", op, failing, others, message));
}

} // namespace shardline::ckpt::detail
