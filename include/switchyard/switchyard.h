// Switchyard: routing, layout, gather and combine for Mixture-of-Experts token traffic.
// Read docs/design.md for the semantics; each header below is the contract of one stage.
#pragma once

#include "switchyard/ep.h"
#include "switchyard/layout.h"
#include "switchyard/permute.h"
#include "switchyard/routing.h"
#include "switchyard/status.h"
#include "switchyard/tensor.h"
#include "switchyard/version.h"
