"""A small tool-using model built and fine-tuned locally, for end-to-end RL on CPUs.

- `model`: a byte-level BPE tokenizer trained in code and a small Qwen2 causal LM,
  saved so that `treadle.agent.chat.HFTokenizer` and vLLM both load them;
- `transcripts`: synthetic tool-use transcripts of the `math` suite, in exactly the
  pieces the agent loop tokenizes (prompt, reply, observation, reply), with the
  observation produced by the real `python` tool;
- `sft`: supervised fine-tuning in plain PyTorch, cached by a hash of its inputs;
- `logprobs`: teacher-forced log-probabilities of a response (engine parity, RL);
- `engine`: an in-process `Engine` that samples from the model (no server needed);
- `evaluate`: held-out success rate with real multi-turn episodes.
- `grpo`, `plot`: GRPO on the checkpoint with rollouts served by treadle, its plot;
- `cli`: `treadle train sft | eval | grpo`.

torch, transformers and tokenizers (the ``train`` extra) are imported inside the
functions that need them, so that importing this package costs nothing.
"""
