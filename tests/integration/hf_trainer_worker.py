"""A worker process of test_worker_package.py's DiLoCoCallback test: a tiny GPT-2 built offline from a
GPT2Config, trained by a Hugging Face Trainer with diloco's callback.  Run with the transformers
environment's python (Makefile: venv-transformers).  It records, for the test's oracle, the bytes of each
delta it sent (<out>/<node>/delta_<base>.safetensors), each global it pulled (<out>/<node>/global_<step>
.safetensors) and the losses it logged (<out>/<node>/losses.json)."""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import diloco
from diloco.integrations.transformers import DiLoCoCallback

VOCAB, SEQ = 64, 32


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def dataset(seed, n=256):
    """Sequences that count up mod VOCAB from a random start: learnable by one layer."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    ids = (starts + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": x, "labels": x} for x in ids]


def main():
    if sys.argv[1] == "--init":
        save_file({k: v.detach().clone() for k, v in tiny_gpt2().state_dict().items()}, sys.argv[2])   # clones: lm_head is tied to wte
        return 0
    url, node, seed, rounds, H, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5]), Path(sys.argv[6])
    torch.set_num_threads(1)
    rec = out / node
    rec.mkdir(parents=True, exist_ok=True)
    model = tiny_gpt2(seed=99)          # not the global's init: the first pull makes it so
    worker = diloco.Worker(url, node)

    pull, put = worker.pull, worker.transport.put_delta

    def recording_pull(m, **kw):
        step = pull(m, **kw)
        save_file({k: v.contiguous() for k, v in worker.baseline.items()}, str(rec / f"global_{step}.safetensors"))
        return step

    def recording_put(n, local_step, delta):
        (rec / f"delta_{worker.step}.safetensors").write_bytes(bytes(delta))
        return put(n, local_step, delta)

    worker.pull, worker.transport.put_delta = recording_pull, recording_put
    cb = DiLoCoCallback(worker, local_steps=H, tokens_per_step=8 * SEQ, wait_timeout=120)
    args = TrainingArguments(output_dir=str(rec / "trainer"), use_cpu=True, report_to=[], save_strategy="no",
                             per_device_train_batch_size=8, max_steps=rounds * H, logging_steps=1,
                             learning_rate=3e-3, seed=seed, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(seed), callbacks=[cb])
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    (rec / "losses.json").write_text(json.dumps({"losses": losses, "results": [r.status for r in cb.results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
