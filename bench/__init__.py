"""The benchmarks behind `triforce bench`, their harness and the GPU campaign; results in bench/RESULTS.md.

User benchmarks (`triforce bench NAME`): offload_bench + offload_run + offload_peers (offload;
offload_predictions: the cost model's table beside it), batch_bench (batch), method_auto (context),
prefill_ttft (prefill), vs_llamacpp (llamacpp), vs_transformers (transformers), serve_bench
(serve-ttft, serve-load), quant_kernels (kernels), tier_steps (tiers). harness: timing, provenance
and the table/JSON/CSV output they share. The GPU campaign (`python -m triforce.bench.gpu_campaign`):
gpu_campaign, and in campaign/ its steps (and their estimates), report, capped, gpu_probe, user_step. Data
tools: make_corpus (the natural-text corpus), random_checkpoint (a random model of a chosen shape)."""
