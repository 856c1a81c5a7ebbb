"""The learning algorithm: PPO losses and updates, the learner loop, normalisation, behaviour cloning."""
