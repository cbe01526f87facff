"""HybridConfig settings the trainer tests share."""

# Small dynamics model and short phases keep the suite fast; semantics are the same as the defaults.
FAST = dict(warmup_steps=8, full_steps=8, correct_steps=3, predict_lengths=(4,), verify_every=4,
            dynamics_hidden=32, dynamics_window=4, dynamics_batch=8, dynamics_train_every=2)
# Mechanism tests that need predicted steps whatever they are worth on this small task.
ALWAYS = dict(confidence_threshold=0.0, min_predicted_worth=-1.0, cost_aware=False)
