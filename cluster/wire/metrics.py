"""Metric keys: slash-namespaced constants, defined here and nowhere else.

Every role returns small metric dicts keyed by these names; only the driver writes them to MLflow.
Templated keys (``{part}``, ``{reason}``, ``{split}``) are filled with ``str.format``.
"""

# rollout
ROLLOUT_REWARD_MEAN = "rollout/reward/mean"
ROLLOUT_REWARD_PART = "rollout/reward/{part}"
ROLLOUT_SEARCH_CALLS_MEAN = "rollout/search_calls/mean"
ROLLOUT_FINISH = "rollout/finish/{reason}"
ROLLOUT_TOKENS_MEAN = "rollout/model_tokens/mean"
ROLLOUT_TRAJ_PER_S = "rollout/trajectories_per_s"
ROLLOUT_TOKENS_PER_S = "rollout/tokens_per_s"
# retrieval
RETRIEVAL_LATENCY_P50 = "retrieval/latency_ms/p50"
RETRIEVAL_LATENCY_P99 = "retrieval/latency_ms/p99"
RETRIEVAL_ERRORS = "retrieval/errors"
RETRIEVAL_CACHE_HIT_RATE = "retrieval/cache/hit_rate"
# learner
LEARNER_LOSS = "learner/loss"
LEARNER_GRAD_NORM = "learner/grad_norm"
LEARNER_LR = "learner/lr"
LEARNER_TOKENS_PER_S = "learner/tokens_per_s"
LEARNER_POLICY_LAG_MAX = "learner/policy_lag/max"
LEARNER_POLICY_LAG_MEAN = "learner/policy_lag/mean"
LEARNER_VERSION = "learner/version"
LEARNER_STEP_TIME = "learner/step_time_s"
# replay
REPLAY_DEPTH = "replay/depth"
REPLAY_PRODUCED = "replay/produced"
REPLAY_CONSUMED = "replay/consumed"
REPLAY_DROPPED_STALE = "replay/dropped_stale"
REPLAY_REQUEUED = "replay/requeued"
# weights
WEIGHTS_SYNC_S = "weights/sync_s"
WEIGHTS_GBPS = "weights/gb_per_s"
# eval
EVAL_EM = "eval/{split}/em"
EVAL_F1 = "eval/{split}/f1"
EVAL_SEARCHES = "eval/{split}/searches_per_question"
