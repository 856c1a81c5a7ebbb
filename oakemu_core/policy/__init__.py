"""What acts: the actor-critic models, action distributions and fast actor inference."""
