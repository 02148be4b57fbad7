# How these files were made: /tmp/duet-base is a release build of 2d8907b, /tmp/duet-pv of this change;
# llama.cpp 0.3.36 (llama-cpp-python, GGML_NATIVE, no AMX); 1 thread on core 0 of this 2-core AMD EPYC (AVX-512 VNNI).
# The matmul-q6k-repeat25 files: the same loop for blk.0.ffn_down.weight at --rows 1,4 --repeat 25, 3 rounds.
cd /work/main
py=.venv/llama/bin/python
for i in 1 2 3; do
  for m in gemma-3-270m-q4_k_m SmolLM2-135M-Instruct.Q4_1; do
    taskset -c 0 $py bench/llama_cpp_engine.py --model models/$m.gguf --threads 1 --steps 16 --batch 1,4 --prefill 512 --json bench/results/decode-kernels-2026-12-07/llama-$m-$i.json > /dev/null 2>&1
    for b in base pv; do
      taskset -c 0 /tmp/duet-$b bench engine --model models/$m.gguf --threads 1 --prefill 512 --batch 1,4 --steps 16 --json bench/results/decode-kernels-2026-12-07/$b-$m-$i.json > /dev/null 2>&1
    done
  done
done
echo done > bench/results/decode-kernels-2026-12-07/done
mkdir -p bench/results/decode-kernels-2026-12-07/mm
for i in 1 2; do
 for t in blk.0.ffn_down.weight blk.0.attn_output.weight token_embd.weight; do
  rows=1,4,16,128; [ $t = token_embd.weight ] && rows=1,4
  for b in base pv; do taskset -c 0 /tmp/duet-$b bench matmul --model models/gemma-3-270m-q4_k_m.gguf --tensor $t --rows $rows --threads 1 --repeat 5 --json bench/results/decode-kernels-2026-12-07/mm/$b-$t-$i.json > /dev/null 2>&1; done
  taskset -c 0 $py bench/llama_cpp_matmul_speed.py --model models/gemma-3-270m-q4_k_m.gguf --tensor $t --rows $rows --threads 1 --repeat 5 2>/dev/null > bench/results/decode-kernels-2026-12-07/mm/llama-$t-$i.json
 done
done
echo done > bench/results/decode-kernels-2026-12-07/mm/done
