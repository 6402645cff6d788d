"""What only some runs need, one module a path; common.py imports each only when its flag asks for it (a copy of a
script without the file a flag needs says so in one line; plot.py is
run on its own):

    hf_models.py   --model, --data, --lora-r: Hugging Face models and data in, the trained policy out (and GGUF)
    hf_routing.py  the experts of Hugging Face MoE models recorded and replayed (Routing Replay on --model)
    static_decode.py --static-cache: sampling with a static KV cache, its decode step a CUDA graph
    rewards.py     --reward FILE.py:NAME, and the answer reward for real data (the default with --data)
    graduate.py    --print-verl, --print-trl, --export-verl-data: the same run in verl or TRL
    plot.py        python -m extras.plot DIR: a run's metrics.jsonl drawn as DIR/metrics.png (needs matplotlib)
"""
