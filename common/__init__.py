"""Engine core shared by every role: config, block manager, model, attention, scheduler."""
