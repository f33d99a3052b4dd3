"""A delta saved from a wrapped model (DDP's "module.", torch.compile's "_orig_mod.") is refused 422
key_mismatch with a message that names the prefix and the fix (README, "Writing a worker"), through the real
dilocod over a real socket, with a real torch DDP wrapper's state_dict (gloo, one process)."""
import socket

import torch
import torch.distributed as dist

from dilocod_proc import Dilocod, write_model
from test_robust import body_of, put, status


def test_ddp_prefixed_delta_names_the_prefix(tmp_path):
    g = torch.Generator().manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    write_model(tmp_path / "init.safetensors", init)
    with socket.socket() as sock:               # a free port for the one-process group's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(net)
        delta = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in wrapped.state_dict().items()}
    finally:
        dist.destroy_process_group()
    assert all(k.startswith("module.") for k in delta)
    d = Dilocod(tmp_path, None, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "2").start()
    try:
        d.wait_until(lambda: status(d).get("outer_step") == 0, "step 0")
        code, answer = put(d, "w1", 1, body_of(delta, "w1", 0, 1))
        assert code == 422 and answer["error"]["code"] == "key_mismatch", answer
        assert 'every key of the delta starts with "module."' in answer["error"]["message"], answer
        assert "model.module" in answer["error"]["message"], answer
        # the unwrapped model's state_dict is taken
        plain = {k[len("module."):]: v for k, v in delta.items()}
        code, answer = put(d, "w1", 2, body_of(plain, "w1", 0, 2))
        assert code in (201, 202), answer
    finally:
        d.stop()
