# The examples as multi-rank tests (label dist; included by tests/dist/CMakeLists.txt when the examples are built).
# Each starts the program under mpiexec as shardline_add_dist_test does (--oversubscribe, --bind-to none, mpiexec's
# --timeout, a CTest TIMEOUT 30 s longer, collectives timing out after half of it). Tiny configurations: a few
# seconds each on a 2-core machine without a GPU.

# shardline_add_example_test(NAME <test> TARGET <example> NP <n> [BACKEND cpu|cuda] [TIMEOUT s] [ARGS ...])
# BACKEND goes to the program as SHARDLINE_BACKEND (launch::Environment's choice): cpu keeps CPU tests on the CPU on a
# GPU host too.
function(shardline_add_example_test)
  cmake_parse_arguments(T "" "NAME;TARGET;NP;BACKEND;TIMEOUT" "ARGS" ${ARGN})
  if(NOT T_NAME OR NOT T_TARGET OR NOT T_NP)
    message(FATAL_ERROR "shardline_add_example_test: NAME, TARGET and NP are required")
  endif()
  if(NOT T_BACKEND)
    set(T_BACKEND cpu)
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 60)
  endif()
  math(EXPR _ctest_timeout "${T_TIMEOUT} + 30")
  math(EXPR _comm_timeout "(${T_TIMEOUT} + 1) / 2")
  add_test(NAME ${T_NAME}
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${T_NP} --oversubscribe --bind-to none
                   --timeout ${T_TIMEOUT} ${SHARDLINE_MPIEXEC_ROOT_FLAGS} ${MPIEXEC_PREFLAGS}
                   $<TARGET_FILE:${T_TARGET}> ${MPIEXEC_POSTFLAGS} ${T_ARGS})
  set_tests_properties(${T_NAME} PROPERTIES
                       LABELS dist TIMEOUT ${_ctest_timeout} PROCESSORS ${T_NP}
                       ENVIRONMENT "SHARDLINE_COMM_TIMEOUT_S=${_comm_timeout};SHARDLINE_BACKEND=${T_BACKEND}")
endfunction()

# The character-level LM, 20 AdamW steps of a tiny model at tp 1, 2 and 4 (np = tp), each writing its losses as JSON
# lines; then the README's claim "the same seed gives the same loss curve for tp 1, 2 and 4": the curves agree step by
# step within float32 rounding (rtol 1e-5, DESIGN.md §7).
set(_char_lm_args --steps 20 --context 8 --hidden 32 --ffn 64 --layers 1 --batch 32 --log-interval 1
                  --eval-interval 1000 --sample-chars 0)
set(_char_lm_curves "")
foreach(_np IN ITEMS 1 2 4)
  set(_metrics ${CMAKE_CURRENT_BINARY_DIR}/example_train_char_lm_tp${_np}.jsonl)
  shardline_add_example_test(NAME dist.example.train_char_lm.np${_np} TARGET train_char_lm NP ${_np}
                             ARGS ${_char_lm_args} --tp ${_np} --metrics ${_metrics})
  set_tests_properties(dist.example.train_char_lm.np${_np} PROPERTIES FIXTURES_SETUP example_char_lm_curves)
  list(APPEND _char_lm_curves ${_metrics})
endforeach()
add_test(NAME dist.example.train_char_lm.same_curve_for_tp_1_2_4
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/scripts/compare_loss_curves.sh 1e-5 ${_char_lm_curves})
set_tests_properties(dist.example.train_char_lm.same_curve_for_tp_1_2_4 PROPERTIES
                     LABELS dist TIMEOUT 30 FIXTURES_REQUIRED example_char_lm_curves)

# dp 2 × tp 2 with GradSync against the tp-2 reference on the whole batch, in one launch; the program checks itself.
shardline_add_example_test(NAME dist.example.train_dp_tp.np4 TARGET train_dp_tp NP 4
                           ARGS --dp 2 --tp 2 --steps 20 --context 8 --hidden 32 --ffn 64 --layers 1 --batch 32)

# The foreign training loop on the functional layer, gradients checked against float64 on the host every step. The
# cuda variants (NCCL, one GPU per rank) exit 77 on every rank without enough GPUs: CTest reports them skipped.
foreach(_np IN ITEMS 2 4)
  shardline_add_example_test(NAME dist.example.embed_functional_cpu.np${_np} TARGET embed_functional NP ${_np}
                             ARGS --backend cpu)
  if(SHARDLINE_WITH_NCCL)
    shardline_add_example_test(NAME dist.example.embed_functional_cuda.np${_np} TARGET embed_functional NP ${_np}
                               BACKEND cuda TIMEOUT 120 ARGS --backend cuda --skip-without-gpus)
    set_tests_properties(dist.example.embed_functional_cuda.np${_np} PROPERTIES SKIP_RETURN_CODE 77)
  endif()
endforeach()

# Checkpoints (issue 17): train_char_lm --save / --load. exact: 8 steps on tp 2 against 4 + save + load + 4, losses and
# final weights bitwise; reshard: saves on dp×tp 1×2 and 2×2 loaded on 1×1, 1×4, 2×1, losses within rtol 1e-5, and the
# safetensors export read back by a json + struct reader; crash: a job killed between its writes and the commit leaves the
# previous checkpoint, which a resume loads; moe: MoE blocks saved on ep 2 × tp 2, resumed on ep 2 × tp 2 (bitwise), ep 2,
# ep 4 and one rank (rtol 1e-5); keep: --save-keep-last 2 (sync and async) leaves exactly the last two step directories
# and `latest` names the newest. Needs python3 (CI installs it).
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND AND SHARDLINE_BUILD_TOOLS)
  foreach(_case IN ITEMS exact reshard crash moe keep)
    add_test(NAME dist.example.train_char_lm.checkpoint_${_case}
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/scripts/char_lm_checkpoint_test.py ${_case}
                     --work ${CMAKE_CURRENT_BINARY_DIR}/char_lm_checkpoint_${_case}
                     --exe $<TARGET_FILE:train_char_lm> --tool $<TARGET_FILE:shardline-ckpt>
                     -- ${MPIEXEC_EXECUTABLE} --oversubscribe --bind-to none --timeout 120
                     ${SHARDLINE_MPIEXEC_ROOT_FLAGS})
    set_tests_properties(dist.example.train_char_lm.checkpoint_${_case} PROPERTIES
                         LABELS dist TIMEOUT 300 PROCESSORS 4
                         ENVIRONMENT "SHARDLINE_COMM_TIMEOUT_S=60;SHARDLINE_BACKEND=cpu")
  endforeach()
endif()

# Mixture of experts (issue 16): the README's MoE run, 4 ranks as dp 1 x ep 2 x tp 2 (4 experts, top-2, an aux loss),
# a few AdamW steps; the JSON lines must carry the aux loss and the expert load, and the loss must fall.
set(_char_lm_moe_metrics ${CMAKE_CURRENT_BINARY_DIR}/example_train_char_lm_moe.jsonl)
shardline_add_example_test(NAME dist.example.train_char_lm_moe.np4 TARGET train_char_lm NP 4 TIMEOUT 120
                           ARGS --num-experts 4 --moe-router-topk 2 --ep 2 --tp 2 --moe-aux-loss-coeff 0.01
                                --steps 30 --context 8 --hidden 32 --ffn 64 --layers 1 --batch 64 --log-interval 5
                                --eval-interval 1000 --sample-chars 0 --metrics ${_char_lm_moe_metrics})
set_tests_properties(dist.example.train_char_lm_moe.np4 PROPERTIES FIXTURES_SETUP example_char_lm_moe)
add_test(NAME dist.example.train_char_lm_moe.loss_falls
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/scripts/check_moe_loss_falls.sh ${_char_lm_moe_metrics})
set_tests_properties(dist.example.train_char_lm_moe.loss_falls PROPERTIES
                     LABELS dist TIMEOUT 30 FIXTURES_REQUIRED example_char_lm_moe)
# The same run with etp 1 below tp 2: whole experts on every tp rank, the tp ranks splitting each block's tokens.
set(_char_lm_moe_etp1_metrics ${CMAKE_CURRENT_BINARY_DIR}/example_train_char_lm_moe_etp1.jsonl)
shardline_add_example_test(NAME dist.example.train_char_lm_moe_etp1.np4 TARGET train_char_lm NP 4 TIMEOUT 120
                           ARGS --num-experts 4 --moe-router-topk 2 --ep 2 --tp 2 --etp 1 --moe-aux-loss-coeff 0.01
                                --steps 30 --context 8 --hidden 32 --ffn 64 --layers 1 --batch 64 --log-interval 5
                                --eval-interval 1000 --sample-chars 0 --metrics ${_char_lm_moe_etp1_metrics})
set_tests_properties(dist.example.train_char_lm_moe_etp1.np4 PROPERTIES FIXTURES_SETUP example_char_lm_moe_etp1)
add_test(NAME dist.example.train_char_lm_moe_etp1.loss_falls
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/scripts/check_moe_loss_falls.sh ${_char_lm_moe_etp1_metrics})
set_tests_properties(dist.example.train_char_lm_moe_etp1.loss_falls PROPERTIES
                     LABELS dist TIMEOUT 30 FIXTURES_REQUIRED example_char_lm_moe_etp1)
