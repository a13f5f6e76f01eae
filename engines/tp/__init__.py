"""Tensor parallelism: one model over N processes (ranks) joined by torch.distributed.

plan.py says which heads and which slice of the MLP each rank holds, shard.py cuts a
loaded model down to one rank's part, group.py is the process group (its all-reduce
and the leader's broadcast of each step), runner.py the leader's runner that hands
every forward to the other ranks and the loop those ranks run. experts.py is expert
parallelism (--ep): a mixture's experts partitioned over the ranks, the tokens' rows
sent to them and back by all-to-all.
"""
