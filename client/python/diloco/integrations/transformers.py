"""DiLoCo for a Hugging Face Trainer: one callback.

    worker = diloco.Worker("http://aggregator:8470", "worker-1")
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[DiLoCoCallback(worker, local_steps=500)])

Before training it pulls the global into the model; every `local_steps` optimizer steps it pushes the
pseudo-gradient (local_step = the Trainer's global_step, which only grows; the last logged loss and the
tokens seen are reported), waits for the next outer step (sync mode) and pulls it.  The inner optimizer
keeps its state across rounds, as DiLoCo does.  follow_recommendation=True (async mode with DyLU) takes
the server's X-Recommended-Local-Steps for the next phase, bounded to
[max(1, local_steps // 16), 4 * local_steps] (diloco.followed_local_steps)."""
from transformers import TrainerCallback


class DiLoCoCallback(TrainerCallback):
    def __init__(self, worker, local_steps, *, follow_recommendation=False, wait=True, wait_timeout=None,
                 tokens_per_step=None):
        if local_steps < 1:
            raise ValueError("local_steps is at least 1")
        self.worker = worker
        self.base_steps = self.phase_steps = int(local_steps)
        self.follow = follow_recommendation
        self.wait, self.wait_timeout = wait, wait_timeout
        self.tokens_per_step = tokens_per_step
        self.since_sync = 0
        self.last_loss = None
        self.results = []           # each push's PushResult, in order

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.worker.pull(model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.last_loss = float(logs["loss"])

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.since_sync += 1
        if self.since_sync < self.phase_steps:
            return
        tokens = None if self.tokens_per_step is None else self.tokens_per_step * self.since_sync
        step = self.worker.step
        result = self.worker.push(model, local_step=state.global_step, loss=self.last_loss, tokens=tokens,
                                  inner_steps=self.since_sync)
        self.results.append(result)
        self.since_sync = 0
        if self.follow:
            self.phase_steps = result.local_steps(self.base_steps)
        # stale: the round moved on without this delta; the next global is there already
        if self.wait and result.status != "stale":
            self.worker.wait(step + 1, timeout=self.wait_timeout)
        self.worker.pull(model)
