"""What a Mixture-of-Experts layer runs: the group ops generated code calls (:mod:`.graph_ops`: routing, dispatch,
combine, the auxiliary losses), the routing they share with the planner (:mod:`.routing`), and the per-forward
records ``autoshard.moe_losses`` / ``autoshard.moe_stats`` read (:mod:`.records`)."""
