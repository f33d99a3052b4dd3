"""s3:// listings are fair per node (issue 21, item 4), against SeaweedFS.

Before, one poll's tables were global and filled from the top of the sorted listing: 8,192 junk
nodes/<x>/ prefixes ahead of an honest node meant its delta was never considered, poll after poll.  Now a
poll that fills a table stops at a node boundary and the next poll starts there (start-after), so every
node is reached within two polls here; the junk is refused as it is met."""
import concurrent.futures
import time

import numpy as np
import requests
import torch

from dilocod_proc import Oracle, assert_state_equal, write_model
from test_s3 import S3Dilocod, put_delta, s3, small_model  # noqa: F401  (s3: the module's fixture)

JUNK_NODES = 8192 + 300         # more than one poll's node table (MAX_NODES_PER_LISTING)


def plant(client, bucket, keys):
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=b"x"), keys))


def test_junk_node_prefixes_do_not_starve_an_honest_node(tmp_path, s3):
    prefix = "fair/run"
    init = small_model(5)
    write_model(tmp_path / "init.safetensors", init)
    client = s3.client()
    t0 = time.monotonic()
    # a0000 .. a8491 sort before the honest node w9
    plant(client, s3.bucket, [f"{prefix}/nodes/a{i:04d}/delta_1.safetensors" for i in range(JUNK_NODES)])
    planted = time.monotonic() - t0
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors",
                  "--expected-nodes", "1", "--nodes", "w9").start()
    try:
        d.wait_step(0, timeout=120)
        rng = np.random.default_rng(3)
        delta = {k: (rng.standard_normal(tuple(v.shape)) * 0.01).astype(np.float32) for k, v in init.items()}
        put_delta(client, s3.bucket, prefix, "w9", 0, 10, delta)
        sent = time.monotonic()
        deadline = sent + 120
        while d.published_step() != 1:
            assert d.alive(), d.log_text()[-3000:]
            # the loop stays live while the junk is listed: a stall detector (a listing parsed on the loop
            # held it for seconds), not a speed bound, so it allows for a loaded ASan build (1.001 s seen)
            t = time.monotonic()
            requests.get(f"{d.url}/healthz", timeout=5).raise_for_status()
            assert time.monotonic() - t < 5.0
            assert time.monotonic() < deadline, f"the honest node's delta not taken in within 120 s:\n" \
                                                f"{d.log_text()[-3000:]}"
            time.sleep(0.2)
        took = time.monotonic() - sent
        want = Oracle(init)
        want.step({"w9": {k: torch.from_numpy(v) for k, v in delta.items()}})
        got = {k: torch.from_numpy(v) for k, v in d.global_state().items()}
        assert_state_equal(got, want.state)
        assert all(torch.isfinite(v).all() for v in got.values())
        print(f"planted {JUNK_NODES} junk prefixes in {planted:.1f} s; honest delta published {took:.1f} s "
              f"after it was put")
    finally:
        assert d.stop() == 0
