"""attnc as a transformers attention backend (``attnc.hf.register``): small random Llama, Qwen2,
Gemma 2 and gpt-oss models built from configs (no downloads), against transformers' own "sdpa"
("eager" for Gemma 2, whose soft-capping SDPA lacks, and for gpt-oss, whose sinks it lacks):
logits on a left-padded batch, greedy generation through the KV cache, and 20 training steps.
Skipped without transformers."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

import attnc.hf  # noqa: E402

NAME = attnc.hf.register()
SMALL = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
CONFIGS = {
    "llama (GQA 4/2)": (lambda: transformers.LlamaConfig(num_key_value_heads=2, **SMALL), "sdpa"),
    "qwen2 (MQA)": (lambda: transformers.Qwen2Config(num_key_value_heads=1, **SMALL), "sdpa"),
    "gemma2 (sliding window, soft-capping)": (
        lambda: transformers.Gemma2Config(
            num_key_value_heads=2, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0, query_pre_attn_scalar=16, **SMALL
        ),
        "eager",
    ),
    "gpt-oss (sinks, sliding window, GQA)": (
        lambda: transformers.GptOssConfig(
            num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2, **SMALL
        ),
        "eager",
    ),
}


def pair(name, init=0.5):
    make, reference = CONFIGS[name]
    config = make()
    config.initializer_range = init  # 0.5: scores far from uniform, so that attention matters
    models = []
    for impl in (reference, NAME):
        torch.manual_seed(0)
        models.append(transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl))
    models[1].load_state_dict(models[0].state_dict())
    return models


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, 20), generator=g)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_generation_match(name):
    ref, ours = (m.eval() for m in pair(name))
    ids, mask = batch()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    scale = float(want[keep].abs().max())
    assert float((got - want)[keep].abs().max()) <= 2e-6 * scale
    with torch.no_grad():
        a = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        b = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["llama (GQA 4/2)", "gemma2 (sliding window, soft-capping)", "gpt-oss (sinks, sliding window, GQA)"])
def test_twenty_training_steps_match(name):
    ids, mask = batch()
    # Padded positions predict nothing: their query rows see no key (left padding), and the
    # backends disagree on such rows (eager's finite mask averages every key; a -inf mask
    # leaves them empty), as transformers' own backends do. The last pad predicts the first
    # token, so that label goes too.
    labels = ids.clone()
    labels[1, :6] = -100
    losses = []
    for model in pair(name, init=0.02):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        run = []
        for _ in range(20):
            opt.zero_grad()
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            run.append(float(loss))
        losses.append(run)
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-4 * abs(a), losses
    assert losses[0][-1] < 0.9 * losses[0][0], "the steps train"


def test_attention_dropout_in_training_mode():
    # A Llama with attention_dropout: training mode drops weights (fused, repeatable under
    # torch.manual_seed, another seed another mask), gradients flow; eval mode drops nothing.
    make, _ = CONFIGS["llama (GQA 4/2)"]
    config = make()
    config.attention_dropout, config.initializer_range = 0.3, 0.5
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
    ids, mask = batch()
    labels = ids.clone()
    labels[1, :6] = -100

    def loss(seed):
        torch.manual_seed(seed)
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    model.train()
    a, again, other = loss(1), loss(1), loss(2)
    assert torch.equal(a, again) and not torch.equal(a, other)
    a.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    model.eval()
    with torch.no_grad():
        assert torch.equal(loss(1), loss(2)) and not torch.equal(loss(1), a.detach())


def test_sinks_are_an_extra_logit_per_head_with_gradients():
    # gpt-oss's definition (transformers' eager gpt-oss attention): the sink joins the logits
    # of each row and is dropped after the softmax. GQA 4/2, causal, in float64 for the
    # reference; the sinks' gradient too.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 7, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 7, 8, generator=g, requires_grad=True)
    sinks = torch.randn(4, generator=g, requires_grad=True)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    out, _ = attnc.hf.attention_forward(module, q, k, v, None, scaling=0.3, s_aux=sinks)
    kk, vv = (x.double().repeat_interleave(2, dim=1) for x in (k, v))
    s = q.double() @ kk.transpose(2, 3) * 0.3
    s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    logits = torch.cat([s, sinks.double().reshape(1, 4, 1, 1).expand(2, 4, 7, 1)], dim=-1)
    want = (torch.softmax(logits, dim=-1)[..., :-1] @ vv).transpose(1, 2)
    assert float((out.double() - want).abs().max()) < 1e-5
    cot = torch.randn(want.shape, generator=g, dtype=torch.float64)
    got_grads = torch.autograd.grad((out.double() * cot).sum(), (q, k, v, sinks))
    want_grads = torch.autograd.grad((want * cot).sum(), (q, k, v, sinks))
    for a, b in zip(got_grads, want_grads):
        assert float((a.double() - b).abs().max()) < 1e-4 * max(1.0, float(b.abs().max()))


def test_position_biases_and_misshapen_sinks_are_errors_not_silence():
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    with pytest.raises(attnc.ShapeError, match="sinks"):
        attnc.hf.attention_forward(module, q, q, q, None, s_aux=torch.zeros(3))
    with pytest.raises(attnc.ArgumentError, match="position bias"):
        attnc.hf.attention_forward(module, q, q, q, None, position_bias=torch.zeros(1, 2, 3, 3))
