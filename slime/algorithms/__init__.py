"""The RL algorithms as pure tensor math (:mod:`slime.algorithms.functional`): rewards, KL, advantages,
policy/value/SFT losses and their registries. Imports only torch; the training backends call it."""
