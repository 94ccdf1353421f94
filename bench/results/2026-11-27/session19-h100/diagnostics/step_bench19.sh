# session 19, the final commit: decode and host rows (linear bench + torch peer), then the MLP block bench (item 4)
b=build-gpu
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export SHARDLINE_COMMIT=$(cat .gl/commit)
lscpu | grep -E "Model name" | head -1; echo "commit $SHARDLINE_COMMIT"
t0=$(date +%s)
BUILD=$b REGIMES=decode,host timeout 200 bench/linear/run_linear_bench.sh $OUT/dec > $OUT/dec.log 2>&1; echo "dec rc=$? $(( $(date +%s) - t0 )) s"
sed -n '/### decode/,/^$/p' $OUT/dec/summary.md | tail -30
sed -n '/### host cost/,/^$/p' $OUT/dec/summary.md
BUILD=$b timeout 280 bench/tp_mlp/run_mlp_block_bench.sh $OUT/block > $OUT/block.log 2>&1; echo "block rc=$? $(( $(date +%s) - t0 )) s"
grep -A12 "floor" $OUT/block/summary.md | head -30
tail -5 $OUT/block.log
