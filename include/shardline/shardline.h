#pragma once

// shardline in one include: the tensor core, the kernel ops, the SPMD rules, communicators and meshes, distributed
// tensors, the functional parallel-Linear core, autograd and the nn modules. Link shardline::shardline.
//
// Not included: <shardline/launch/bootstrap.h> (a program's MPI bootstrap, target shardline::launch, built with MPI)
// and <shardline/config.h>'s build switches, which every header here already sees.

#include <shardline/autograd/engine.h>
#include <shardline/autograd/function.h>
#include <shardline/autograd/functions.h>
#include <shardline/autograd/moe.h>
#include <shardline/autograd/variable.h>
#include <shardline/ckpt/checkpoint.h>
#include <shardline/ckpt/metadata.h>
#include <shardline/comm/communicator.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/device.h>
#include <shardline/core/dtype.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/dist/ops.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/kernels/ops.h>
#include <shardline/nn/checkpoint.h>
#include <shardline/nn/grad_sync.h>
#include <shardline/nn/init.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/mlp.h>
#include <shardline/nn/module.h>
#include <shardline/nn/optim.h>
#include <shardline/spmd/spmd.h>
