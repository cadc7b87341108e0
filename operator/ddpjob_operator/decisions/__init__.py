"""Pure decisions over what was observed: the job's lifecycle, its status, result, progress and health. Import only builders and api."""
