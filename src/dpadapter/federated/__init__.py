"""DP federated fine-tuning of pre-trained models (Pretrain-DPFL).

partition   Dirichlet-alpha label split of a private task into N clients
mechanisms  client-side Gaussian (Opacus) and Laplace (Theorem 1) mechanisms, per-client ledgers
estimate    private estimates of the theorems' constants and the T1 rule (Theorems 2-3)
simulation  FedSGD/FedAvg rounds over the clients
stage       one grid job -> metrics.json; summary: CSV, rule hit rate, figures
plots       the figures (analogues of the paper's Figs. 1-3)

Layer 5 (an experiment built on the loops): it may import `train` and everything below, and
the other experiments of its layer, never a stage or an entry point.
"""
