# bench/hf_decode_bench.py writes this next to hf_decode.csv; redraw with: gnuplot hf_decode.gp (in this folder)
set datafile separator comma
set terminal pngcairo size 1500,600 font ",10" noenhanced
set output "hf_decode.png"
meta = system("sed -n 2p hf_decode.csv | cut -c3-")
set multiplot layout 1,2 title "kvevict.hf: one decode step of a DeepSeek-V3-sized MLA layer (capacity 4612)\n".meta font ",9"
set logscale x 2
set logscale y 10
set xtics (1024, 2048, 4096, 8192, 16384, 32768)
set xlabel "context (tokens)"
set key below
set grid
set xrange [700:48000]
# the CSV's rows are by variant, then context: one variant's rows are consecutive, 1/0 elsewhere
col(v, c) = (strcol(2) eq v ? column(c) : 1/0)
do for [panel = 1:2] {
  c = (panel == 1 ? 4 : 6)
  set title (panel == 1 ? "whole 1-layer model forward (d: its attention alone)" : "attention module forward")
  set ylabel (panel == 1 ? "ms per decode step (median)" : "ms per attention forward (median)")
  plot "hf_decode.csv" using 1:(col("a_dynamic", c)) with linespoints lw 2 pt 7 title "(a) DynamicCache", \
       "hf_decode.csv" using 1:(col("b_kvevict", c)) with linespoints lw 2 pt 7 title "(b) kvevict hf", \
       "hf_decode.csv" using 1:(col("c_kvevict_tier", c)) with linespoints lw 2 pt 7 title "(c) kvevict hf + tier", \
       "hf_decode.csv" using 1:(col("d_direct", c)) with linespoints lw 2 pt 7 title "(d) kvevict direct (no transformers)"
}
unset multiplot
