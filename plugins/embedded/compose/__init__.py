"""The compositional embedded world: several coloured shapes on one canvas, prompts in GenEval's six
categories, an embedded detector and GenEval's scoring rules (``flowrl.geneval``); see MODEL_CARD.md
beside this file."""
