#pragma once

// Umbrella header of the SPMD rules library (no CUDA, no MPI, nothing else of shardline).

#include <shardline/spmd/einsum.h>
#include <shardline/spmd/error.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/limits.h>
#include <shardline/spmd/mesh.h>
#include <shardline/spmd/redistribute.h>
#include <shardline/spmd/rule_cache.h>
#include <shardline/spmd/rules.h>
