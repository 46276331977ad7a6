#pragma once
// kvevict: H2O-style KV-cache eviction for DeepSeek-style (MLA) models, on LibTorch.

#include <kvevict/version.hpp>
#include <kvevict/check.hpp>
#include <kvevict/options.hpp>
#include <kvevict/scorers.hpp>
#include <kvevict/selection.hpp>
#include <kvevict/slot_moves.hpp>
#include <kvevict/eviction_policy.hpp>
#include <kvevict/mla_cache.hpp>
#include <kvevict/mla_latent_cache.hpp>
#include <kvevict/attention.hpp>
#include <kvevict/lse_scores.hpp>
#include <kvevict/prefill.hpp>
#include <kvevict/memory_model.hpp>
#include <kvevict/kernels.hpp>
