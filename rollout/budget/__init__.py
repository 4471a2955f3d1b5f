"""The draft budget: how many draft tokens each request gets a step, from the step-cost model of the device."""
