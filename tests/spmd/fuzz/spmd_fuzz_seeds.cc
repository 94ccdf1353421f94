// The fuzzer's seed requests: one or more of every request kind, and the known hard cases.

#include "spmd_fuzz.h"

namespace shardline::spmd::fuzz {

const std::vector<std::string> &SeedRequests() {
    static const std::vector<std::string> seeds = {
        // The case of issue 19: a mesh dim of 2^31 (the cost of a query must not grow with the rank count).
        R"j({"op":"linear","mesh":{"shape":[2147483648]},"inputs":[{"shape":[64,32]},{"shape":[48,32],
            "dims_mapping":[0,-1]}]})j",
        R"j({"op":"linear","direction":"grad","mesh":{"shape":[2147483648,2]},"inputs":[{"shape":[64,32],
            "dims_mapping":[0,-1]},{"shape":[48,32],"dims_mapping":[1,-1]}],"out_grad":{"shape":[64,48]}})j",
        R"j({"op":"redistribute","mesh":{"shape":[2147483648]},"shape":[8,8],"src":{"dims_mapping":[0,-1]},
            "dst":{"dims_mapping":[-1,0]}})j",
        // Rules, every op.
        R"j({"op":"matmul","mesh":{"shape":[2,4],"dim_names":["dp","tp"]},"inputs":[{"shape":[8,64,32],
            "dims_mapping":["dp",-1,"tp"]},{"shape":[32,16],"dims_mapping":["tp",-1]}],"attrs":{"trans_x":false}})j",
        R"j({"op":"matmul","direction":"grad","mode":"cost","mesh":{"shape":[2,2]},"inputs":[{"shape":[6,5],
            "placements":["S(0)","P(sum)"]},{"shape":[7,5],"layout":"[1,-1]"}],"attrs":{"trans_y":true},
            "out_grad":{"shape":[6,7],"dims_mapping":[0,-1]}})j",
        R"j({"op":"matmul","direction":"reverse","mesh":{"shape":[3]},"inputs":[{"shape":[5]},{"shape":[5,7]}],
            "outputs":[{"shape":[7],"dims_mapping":[0]}]})j",
        R"j({"op":"linear","mesh":{"shape":[4],"dim_names":["tp"]},"inputs":[{"name":"x","shape":[64,32],
            "dims_mapping":[-1,0]},{"name":"weight","shape":[48,32],"dims_mapping":[-1,0]},{"name":"bias",
            "shape":[48],"dims_mapping":[-1]}],"outputs":[{"shape":[64,48],"dims_mapping":[0,-1]}]})j",
        R"j({"op":"linear","mesh":{"shape":[2,2]},"inputs":[{"shape":[32,10],"dims_mapping":[0,1]},
            {"shape":[32,12],"dims_mapping":[-1,0]}],"attrs":{"trans_x":true,"trans_y":false}})j",
        R"j({"op":"linear","direction":"grad","mode":"cost","mesh":{"shape":[2,4]},"inputs":[{"shape":[64,32],
            "dims_mapping":[0,-1]},{"shape":[48,32],"dims_mapping":[1,-1]},{"shape":[48]}],
            "out_grad":{"shape":[64,48],"dims_mapping":[0,1]},"cost_profile":"mpi_cpu"})j",
        R"j({"op":"moe_dispatch","mesh":{"shape":[2,2,2],"dim_names":["dp","ep","tp"]},"inputs":[{"shape":[64,32],
            "dims_mapping":[["dp","ep"],"tp"]}],"attrs":{"num_experts":8,"topk":2,"capacity":3},"mode":"cost"})j",
        R"j({"op":"moe_combine","direction":"grad","mesh":{"shape":[2,2],"dim_names":["ep","dp"]},"inputs":[
            {"shape":[64,32],"dims_mapping":[["ep","dp"],-1]}],"out_grad":{"shape":[32,32],"partial":[1]},
            "attrs":{"num_experts":4,"topk":2,"ep_dim":"ep"}})j",
        R"j({"op":"embedding","mesh":{"shape":[4]},"inputs":[{"shape":[8,16]},{"shape":[1000,64],
            "dims_mapping":[0,-1]}]})j",
        R"j({"op":"embedding","direction":"grad","mesh":{"shape":[2]},"inputs":[{"shape":[8,16]},{"shape":[1000,64],
            "dims_mapping":[-1,0]}],"out_grad":{"shape":[8,16,64]},"attrs":{"sparse":true}})j",
        R"j({"op":"embedding_bag","mesh":{"shape":[2,2]},"inputs":[{"shape":[3,8],"dims_mapping":[0,-1]},
            {"shape":[100,16],"dims_mapping":[1,-1]}]})j",
        R"j({"op":"softmax","mesh":{"shape":[2]},"inputs":[{"shape":[4,10],"dims_mapping":[-1,0]}],
            "attrs":{"axis":-1,"vocab_parallel":true}})j",
        R"j({"op":"log_softmax","direction":"grad","mesh":{"shape":[3]},"inputs":[{"shape":[5,7]}],
            "out_grad":{"shape":[5,7],"dims_mapping":[0,-1]}})j",
        R"j({"op":"cross_entropy","mesh":{"shape":[2,2]},"inputs":[{"shape":[8,4,50],"dims_mapping":[0,-1,1]},
            {"shape":[8,4],"dims_mapping":[0,-1]}],"attrs":{"reduction":"mean","vocab_parallel":true}})j",
        R"j({"op":"cross_entropy","direction":"grad","mesh":{"shape":[2]},"inputs":[{"shape":[8,50]},
            {"shape":[8]}],"out_grad":{"shape":[8],"partial":[0]}})j",
        R"j({"op":"transpose","mesh":{"shape":[2,3]},"inputs":[{"shape":[4,5,6],"dims_mapping":[[0,1],-1,-1],
            "partial":{}}],"attrs":{"perm":[2,0,1]}})j",
        R"j({"op":"reshape","mesh":{"shape":[2]},"inputs":[{"shape":[4,6],"dims_mapping":[0,-1]}],
            "attrs":{"shape":[-1]}})j",
        R"j({"op":"reshape","direction":"reverse","mesh":{"shape":[2]},"inputs":[{"shape":[4,6]}],
            "outputs":[{"shape":[24],"dims_mapping":[0]}]})j",
        R"j({"op":"einsum","mesh":{"shape":[2,2]},"inputs":[{"shape":[4,5,6],"dims_mapping":[0,-1,1]},
            {"shape":[6,7]}],"attrs":{"equation":"bmk,kn->bmn"}})j",
        R"j({"op":"sum","mesh":{"shape":[2]},"inputs":[{"shape":[4,6],"dims_mapping":[-1,0]}],
            "attrs":{"axes":[1],"keepdim":true}})j",
        R"j({"op":"max","direction":"grad","mesh":{"shape":[2]},"inputs":[{"shape":[4,6],"dims_mapping":[-1,0]}],
            "out_grad":{"shape":[4]}})j",
        R"j({"op":"add","mesh":{"shape":[2]},"inputs":[{"shape":[4,6],"partial":[0]},{"shape":[6]}]})j",
        R"j({"op":"multiply","mesh":{"shape":[2]},"inputs":[{"shape":[4,6],"partial":{"0":"prod"}},
            {"shape":[4,6],"partial":{"0":"prod"}}]})j",
        R"j({"op":"identity","mesh":{"shape":[3]},"inputs":[{"shape":[5],"placements":["P(prod)"]}]})j",
        R"j({"op":"relu","mesh":{"shape":[2]},"inputs":[{"shape":[4],"layout":"[-1] partial{0:max}"}],
            "dtype":"bfloat16"})j",
        // Enumeration.
        R"j({"op":"einsum","direction":"enumerate","mesh":{"shape":[2,2]},"inputs":[{"shape":[8,16],
            "dims_mapping":[0,-1]},{"shape":[16,4]}],"attrs":{"equation":"mk,kn->mn"}})j",
        R"j({"op":"matmul","direction":"enumerate","mesh":{"shape":[4]},"inputs":[{"shape":[2,8,16]},
            {"shape":[16,4],"dims_mapping":[-1,0]}]})j",
        R"j({"op":"linear","direction":"enumerate","mesh":{"shape":[2,2,2]},"inputs":[{"shape":[8,16]},
            {"shape":[4,16],"dims_mapping":[0,-1]},{"shape":[4]}],"cost_model":{"call_us":0}})j",
        // Redistribution.
        R"j({"op":"redistribute","mesh":{"shape":[2,4],"dim_names":["dp","tp"]},"shape":[10,8],"dtype":"bfloat16",
            "src":{"dims_mapping":[-1,1],"partial":[0]},"dst":{"placements":["S(0)","R"]}})j",
        R"j({"op":"redistribute","mesh":{"shape":[2,2,2]},"shape":[7,5,3],"src":{"layout":"[[0,1],2,-1]"},
            "dst":{"layout":"[2,-1,[1,0]]"},"cost_model":{"call_us":0,"alpha_us":0.001,
            "bandwidth_gb_per_s_per_dim":[1,4,1]}})j",
        R"j({"op":"redistribute","mesh":{"shape":[3,3,3,3]},"shape":[9,9,9,9],"src":{"layout":"[0,1,2,3]"},
            "dst":{"layout":"[3,2,1,0]"},"cost_model":{"call_us":0,"alpha_us":0}})j",
        R"j({"op":"redistribute","mesh":{"shape":[2]},"shape":[6],"src":{"placements":["P(prod)"]},
            "dst":{"placements":["S(0)"]}})j",
        R"j({"op":"redistribute","mesh":{"shape":[2,2],"process_ids":[3,1,0,2]},"shape":[4],
            "src":{"partial":{"0":"sum","1":"max"}},"dst":{}})j",
        // Near the limits.
        R"j({"op":"redistribute","mesh":{"shape":[1024,1024]},"shape":[1125899906842624],
            "src":{"dims_mapping":[[0,1]]},"dst":{"dims_mapping":[-1]},"element_size":64})j",
        R"j({"op":"matmul","mode":"cost","mesh":{"shape":[2,2,2,2,2,2]},"inputs":[{"shape":[2,2,2,2,2,2,2,2]},
            {"shape":[2,2,2,2,2,2,2,2]}]})j",
        R"j({"op":"einsum","mode":"cost","mesh":{"shape":[3,3,3]},"inputs":[{"shape":[2,3,4,5,6,7]},
            {"shape":[7,6,5,4,3,2]}],"attrs":{"equation":"abcdef,fedcba->af"}})j",
    };
    return seeds;
}

} // namespace shardline::spmd::fuzz
