"""Write a tiny random-weight Llama and a locally trained byte-level BPE tokenizer to a directory (no downloads).

``python tests/vllm_procs/make_model.py DIR``. The weights are scaled up
(``initializer_range``) so greedy choices are decided by clear margins, not
by float noise that differs between batch shapes.
"""

from __future__ import annotations

import sys
from pathlib import Path


#: A model sized like a real one relative to its KV bytes, for the benchmarks (``make_model(out, **SIZED)``):
#: its 2048-token prefill takes seconds on a small CPU box, while its KV (fp32) reads over NIXL in tens of ms.
SIZED = {"hidden": 1024, "intermediate": 4096, "layers": 8, "heads": 16, "kv_heads": 4}


def make_model(out: Path, *, vocab: int = 512, seed: int = 0, max_positions: int = 2048, heads: int = 2,
               kv_heads: int = 2, hidden: int = 128, intermediate: int = 256, layers: int = 2) -> Path:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    corpus = [f"remote g2 shares kv cache block {i} between workers over nixl; prefix {i * 7 % 13}" for i in range(400)]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(corpus, vocab_size=vocab, min_frequency=1, special_tokens=["<s>", "</s>", "<unk>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                         initializer_range=0.2, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                         torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def make_mla_model(out: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight DeepSeek-V2 (MLA, dense layers only) with :func:`make_model`'s tokenizer.

    The latent is 512 + 64 wide (``kv_lora_rank`` + ``qk_rope_head_dim``): vLLM's CPU MLA kernels take that
    width only. bfloat16: its AMX MLA backend (the one that keeps prefix caching on) runs nothing else.
    """
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    make_model(out, seed=seed)
    for f in out.glob("model*.safetensors"):
        f.unlink()
    torch.manual_seed(seed)
    config = DeepseekV2Config(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                              num_hidden_layers=2, first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1,
                              num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=2,
                              num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                              qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=2048,
                              initializer_range=0.2, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                              torch_dtype="bfloat16")
    DeepseekV2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def make_lora(model_dir: Path, out: Path, *, seed: int = 1) -> Path:
    """A tiny random LoRA adapter (r=8 on q/k/v/o) for the model in ``model_dir``, saved with ``peft``.

    Its B matrices are random (peft starts them at zero, which would make the
    adapter a no-op): the adapter's K and V differ from the base model's.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                            lora_dropout=0.0, bias="none"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(make_model(Path(sys.argv[1])))
