"""Fitting the tree to the heads and the hardware: exact replay of greedy decoding on held-out chats
(`replay`), measured step costs (`cost`), and the calibration and choice (`calibrate`)."""
from medusa_jax.tuning.calibrate import choose_tree, rank_accuracies
from medusa_jax.tuning.cost import step_costs
from medusa_jax.tuning.replay import Replay, path_ranks, search_tree

__all__ = ["Replay", "choose_tree", "path_ranks", "rank_accuracies", "search_tree", "step_costs"]
