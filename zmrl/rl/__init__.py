"""The RL loop's pieces: rewards, datasets, tokenizers, the synthetic task and the SFT bootstrap."""
