# How these files were made: target/release/duet is a release build of 49ef129 (engine as at
# 139fac8); llama.cpp 0.3.36 (llama-cpp-python, GGML_NATIVE, no AMX); 1 thread on core 0 of
# this 2-core Intel Xeon (model 207, 2.1 GHz, AVX-512 VNNI), 3 alternating rounds.
cd /work/main
py=.venv/llama/bin/python
out=bench/results/engine-intel-2026-12-07
for i in 1 2 3; do
  for m in SmolLM2-135M-Instruct.Q4_1 gemma-3-270m-q4_k_m; do
    taskset -c 0 $py bench/llama_cpp_engine.py --model models/$m.gguf --threads 1 --steps 16 --batch 1,4 --prefill 512 --json $out/llama-$m-$i.json > /dev/null 2>&1
    taskset -c 0 target/release/duet bench engine --model models/$m.gguf --threads 1 --prefill 512 --batch 1,4 --steps 16 --json $out/duet-$m-$i.json > /dev/null 2>&1
  done
done
echo done > $out/done
