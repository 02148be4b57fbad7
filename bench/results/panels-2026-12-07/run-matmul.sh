cd /work/main
py=.venv/llama/bin/python
mkdir -p /tmp/mm
for i in 1 2; do
 for t in blk.0.attn_output.weight blk.0.ffn_down.weight blk.0.attn_q.weight blk.0.attn_v.weight; do
  for b in base new; do taskset -c 0 /tmp/duet-$b bench matmul --model models/gemma-3-270m-q4_k_m.gguf --tensor $t --rows 1,4,16,128 --threads 1 --repeat 9 --json /tmp/mm/$b-$t-$i.json > /dev/null 2>&1; done
  taskset -c 0 $py bench/llama_cpp_matmul_speed.py --model models/gemma-3-270m-q4_k_m.gguf --tensor $t --rows 1,4,16,128 --threads 1 --repeat 9 2>/dev/null > /tmp/mm/llama-$t-$i.json
 done
done
echo done > /tmp/mm/done
