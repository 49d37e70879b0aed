"""xlipkit losses: contrastive and structure losses for CLIP-family models, torch only."""
