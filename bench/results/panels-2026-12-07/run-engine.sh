# How these files were made: /tmp/duet-base is a release build of ddbabaa (before the panels),
# /tmp/duet-new of this change; llama.cpp 0.3.36 built with GGML_NATIVE (AVX-512); 1 thread on core 0.
cd /work/main
py=.venv/llama/bin/python
for i in 1 2 3; do
  for m in gemma-3-270m-q4_k_m SmolLM2-135M-Instruct.Q4_1; do
    taskset -c 0 $py bench/llama_cpp_engine.py --model models/$m.gguf --threads 1 --steps 16 --batch 1,4 --prefill 512 --json /tmp/be/llama-$m-$i.json > /dev/null 2>&1
    for b in base new; do
      taskset -c 0 /tmp/duet-$b bench engine --model models/$m.gguf --threads 1 --prefill 512 --batch 1,4 --steps 16 --json /tmp/be/$b-$m-$i.json > /dev/null 2>&1
    done
  done
done
echo done > /tmp/be/done
