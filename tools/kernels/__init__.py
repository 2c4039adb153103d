"""The Triton ops measured alone: MoE and attention sweeps, the MoE op piece by piece, launch overhead, tile
tuning, and the registers a kernel takes."""
