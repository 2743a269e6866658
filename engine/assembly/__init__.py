"""Assembly: validate, build the groups, pick a builder per kind of model, assemble the engine."""
