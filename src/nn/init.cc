#include <shardline/core/error.h>
#include <shardline/nn/init.h>
#include <shardline/spmd/mesh.h>

namespace shardline::nn {

autograd::Variable MakeParameter(const Shape &global_shape, const spmd::Layout &layout, comm::DeviceMesh *mesh,
                                 const ParameterOptions &options, RandomSpec spec) {
    spec.seed = options.seed;
    if (mesh == nullptr) {
        Tensor t = Tensor::Empty(global_shape, options.dtype, options.device);
        FillRandom(t, spec);
        autograd::Variable v(std::move(t), true);
        v.set_name(std::string(spec.name));
        return v;
    }
    const spmd::ProcessMesh pm(mesh->shape(), mesh->dim_names());
    const spmd::LocalShard shard = spmd::ComputeLocalShard(pm, global_shape, layout, mesh->coordinate());
    Tensor local = Tensor::Empty(shard.shape, options.dtype, options.device);
    FillRandomShard(local, spec, global_shape, shard.offset);
    autograd::Variable v(dist::DistTensor(std::move(local), global_shape, layout, *mesh), true);
    v.set_name(std::string(spec.name));
    return v;
}

} // namespace shardline::nn
