"""What the Hugging Face conversion tests share: tools/checkpoint/convert.py loaded as a module (it
is a script, not a package member), a conversion run through its main(), an exported
checkpoint's tensors, the round trip back to Hugging Face, and a megalite model's first MTP loss."""
import importlib.util
import os

from dist_helpers import ROOT


def convert_tool():
    """tools/checkpoint/convert.py as a module (one instance per test module that asks)."""
    spec = importlib.util.spec_from_file_location("megalite_convert", os.path.join(ROOT, "tools/checkpoint/convert.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_convert(convert, loader: str, saver: str, src, dst, *extra) -> str:
    """One conversion (--loader -> --saver) that must succeed; returns the output directory."""
    assert convert.main(["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", str(src),
                         "--save-dir", str(dst), *extra]) == 0
    return str(dst)


def safetensors_of(directory) -> dict:
    """The tensors of a one-file Hugging Face checkpoint."""
    from safetensors.torch import load_file
    return load_file(os.path.join(directory, "model.safetensors"))


def export_back(convert, ck, hf_dir, dst, *extra) -> tuple[str, dict, dict]:
    """Export megalite checkpoint `ck` (imported from `hf_dir`) back to Hugging Face in `dst`; its
    tensors must be `hf_dir`'s, the same names and values. Returns (dst, the exported tensors, its
    config.json)."""
    import json

    import torch
    back = run_convert(convert, "megalite", "hf", ck, dst, "--no-tokenizer", *extra)
    original, exported = safetensors_of(hf_dir), safetensors_of(back)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    with open(os.path.join(back, "config.json")) as f:
        return back, exported, json.load(f)


def mtp_loss(model, tokens):
    """MTP module 1's mean cross entropy (training forward, the loss falling on every position that
    has a target two tokens on) and its hidden states [s, b, h]."""
    import torch
    b, s = tokens.size(0), tokens.size(1) - 1
    model.train()
    captured = []
    handle = model.mtp.layers[0].register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    with torch.no_grad():
        model(tokens[:, :-1], torch.arange(s).expand(b, s), labels=tokens[:, 1:], loss_mask=torch.ones(b, s))
    handle.remove()
    (loss_sum, count, _), = model.mtp_results
    assert count == b * (s - 1)
    return (loss_sum / count).item(), captured[0]


def printed_run(printed: str):
    """The run config that the flags convert.py printed ("Continue training with: pretrain_gpt.py ...")
    build, with a mock dataset and one iteration added: what a user pasting them gets."""
    import shlex

    from megalite.arguments import parse_config
    flags = shlex.split(printed.split("pretrain_gpt.py ")[1].splitlines()[0].removesuffix(" ..."))
    return parse_config(flags + ["--mock-data", "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "1",
                                 "--lr", "1e-3"], 1, check_files=False)
