// The engine's reports as the Python module returns them: the capacity plan, a text's expert
// load, routing traces (read and summarised). Each calls the library function the CLI's
// command calls (model/capacity_plan.h, runtime/expert_load.h, profile/routing_trace.h).
#pragma once

#include <nanobind/nanobind.h>

namespace moeinfer::python {

void bind_reports(nanobind::module_& m);

}  // namespace moeinfer::python
