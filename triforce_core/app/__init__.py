"""The application layer: the runtime builder, planning, chat, evaluation, tuning, tensor-parallel launch."""
