"""RunPod's GraphQL schema (the part its SDK, SkyPilot, dstack and runpodctl use), as SDL.

Types follow RunPod's published schema (graphql-spec.runpod.io) so the literal kinds
clients write parse: ``cloudType: ALL`` is an enum, ``dataCenterId: null`` an explicit
null, ``containerRegistryAuthId: ""`` a string, ``allowedCudaVersions`` a list,
``podTerminate`` a scalar. Resolvers are bound in ``graphql_resolvers``.
"""

from __future__ import annotations

from graphql import GraphQLSchema, build_schema

#: Fields shared by the three pod-creating inputs (on-demand, CPU, interruptible).
_POD_INPUT_FIELDS = """
  name: String
  imageName: String
  cloudType: CloudTypeEnum
  computeType: String
  gpuTypeId: String
  gpuTypeIdList: [String]
  gpuCount: Int
  instanceId: String
  minVcpuCount: Int
  minMemoryInGb: Int
  minDisk: Int
  containerDiskInGb: Int
  volumeInGb: Int
  volumeMountPath: String
  volumeKey: String
  dockerArgs: String
  ports: String
  env: [EnvironmentVariableInput]
  templateId: String
  networkVolumeId: String
  startSsh: Boolean
  startJupyter: Boolean
  supportPublicIp: Boolean
  dataCenterId: String
  countryCode: String
  allowedCudaVersions: [String]
  cudaVersion: String
  minDownload: Int
  minUpload: Int
  containerRegistryAuthId: String
  deployCost: Float
  port: Int
  stopAfter: String
  terminateAfter: String
  aiApiId: String
  savingsPlan: SavingsPlanInput
"""

SDL = f"""
enum CloudTypeEnum {{ ALL SECURE COMMUNITY }}
enum PodStatus {{ CREATED RUNNING RESTARTING EXITED PAUSED DEAD TERMINATED }}
enum PodType {{ INTERRUPTABLE RESERVED BID BACKGROUND }}
enum FlashBootType {{ FLASHBOOT OFF }}
scalar Void

type Query {{
  myself: User
  gpuTypes(input: GpuTypeFilter): [GpuType]
  pod(input: PodFilter!): Pod
}}

type Mutation {{
  podFindAndDeployOnDemand(input: PodFindAndDeployOnDemandInput): Pod
  deployCpuPod(input: DeployCpuPodInput): Pod
  podRentInterruptable(input: PodRentInterruptableInput!): Pod
  podStop(input: PodStopInput!): Pod
  podResume(input: PodResumeInput!): Pod
  podBidResume(input: PodBidResumeInput!): Pod
  podRestart(input: PodRestartInput!): Pod
  podTerminate(input: PodTerminateInput!): Void
  updateUserSettings(input: UpdateUserSettingsInput!): User
  saveTemplate(input: SaveTemplateInput): PodTemplate
  deleteTemplate(templateName: String!): Void
  createNetworkVolume(input: CreateNetworkVolumeInput!): NetworkVolume
  deleteNetworkVolume(input: DeleteNetworkVolumeInput!): Void
  saveRegistryAuth(input: SaveRegistryAuthInput!): RegistryAuth
  deleteRegistryAuth(registryAuthId: String!): Void
  saveEndpoint(input: EndpointInput!): Endpoint
  updateEndpointTemplate(input: UpdateEndpointTemplateInput!): Endpoint
  deleteEndpoint(id: String!): Void
}}

input GpuTypeFilter {{ id: String ids: [String] }}
input PodFilter {{ podId: String! }}
input GpuLowestPriceInput {{
  gpuCount: Int minDisk: Int minMemoryInGb: Int minVcpuCount: Int secureCloud: Boolean
  compliance: [String] dataCenterId: String countryCode: String minDownload: Int
  minUpload: Int supportPublicIp: Boolean includeAiApi: Boolean allowedCudaVersions: [String]
}}
input EnvironmentVariableInput {{ key: String! value: String }}
input SavingsPlanInput {{ planLength: String upfrontCost: Float }}
input PodFindAndDeployOnDemandInput {{ {_POD_INPUT_FIELDS} }}
input DeployCpuPodInput {{ {_POD_INPUT_FIELDS} }}
input PodRentInterruptableInput {{ bidPerGpu: Float! {_POD_INPUT_FIELDS} }}
input PodStopInput {{ podId: String! incrementVersion: Boolean }}
input PodResumeInput {{ podId: String! gpuCount: Int syncMachine: Boolean }}
input PodBidResumeInput {{ podId: String! bidPerGpu: Float! gpuCount: Int }}
input PodTerminateInput {{ podId: String! }}
input PodRestartInput {{ podId: String! }}
input CreateNetworkVolumeInput {{ name: String! size: Int! dataCenterId: String }}
input DeleteNetworkVolumeInput {{ id: String! }}
input SaveRegistryAuthInput {{ name: String! username: String! password: String! }}
input UpdateUserSettingsInput {{ pubKey: String }}
input EndpointInput {{
  id: String name: String templateId: String gpuIds: String networkVolumeId: String
  locations: String idleTimeout: Int scalerType: String scalerValue: Int workersMin: Int
  workersMax: Int allowedCudaVersions: String gpuCount: Int flashBootType: FlashBootType
  executionTimeoutMs: Int
}}
input UpdateEndpointTemplateInput {{ endpointId: String! templateId: String! }}
input SaveTemplateInput {{
  id: String name: String! imageName: String! dockerArgs: String containerDiskInGb: Int
  volumeInGb: Int volumeMountPath: String ports: String env: [EnvironmentVariableInput]
  isServerless: Boolean startSsh: Boolean startJupyter: Boolean isPublic: Boolean
  readme: String containerRegistryAuthId: String category: String
}}

type User {{
  id: String
  email: String
  pubKey: String
  pods: [Pod]
  networkVolumes: [NetworkVolume]
  containerRegistryCreds: [RegistryAuth]
  podTemplates: [PodTemplate]
  endpoints: [Endpoint]
}}

type Endpoint {{
  id: String
  name: String
  templateId: String
  gpuIds: String
  networkVolumeId: String
  networkVolume: NetworkVolume
  locations: String
  idleTimeout: Int
  scalerType: String
  scalerValue: Int
  workersMin: Int
  workersMax: Int
  workersStandby: Int
  allowedCudaVersions: String
  gpuCount: Int
  flashBootType: FlashBootType
  executionTimeoutMs: Int
  aiKey: String
  type: String
  userId: String
  version: Int
  env: [EnvironmentVariable]
  createdAt: String
}}

type NetworkVolume {{ id: String name: String size: Int dataCenterId: String }}
type RegistryAuth {{ id: String name: String }}

type GpuType {{
  id: String
  displayName: String
  manufacturer: String
  memoryInGb: Int
  cudaCores: Int
  secureCloud: Boolean
  communityCloud: Boolean
  securePrice: Float
  communityPrice: Float
  oneMonthPrice: Float
  threeMonthPrice: Float
  oneWeekPrice: Float
  communitySpotPrice: Float
  secureSpotPrice: Float
  maxGpuCount: Int
  maxGpuCountSecureCloud: Int
  maxGpuCountCommunityCloud: Int
  lowestPrice(input: GpuLowestPriceInput): LowestGpuPrice
}}

type LowestGpuPrice {{
  gpuName: String
  gpuTypeId: String
  minimumBidPrice: Float
  uninterruptablePrice: Float
  minMemory: Int
  minVcpu: Int
  stockStatus: String
  maxUnreservedGpuCount: Int
  availableGpuCounts: [Int]
  compliance: [String]
  countryCode: String
  rentalPercentage: Float
}}

type Pod {{
  id: String
  name: String
  desiredStatus: PodStatus
  imageName: String
  env: [String]
  machineId: String
  machine: PodMachineInfo
  runtime: PodRuntime
  costPerHr: Float
  adjustedCostPerHr: Float
  gpuCount: Int
  vcpuCount: Float
  memoryInGb: Float
  volumeInGb: Int
  containerDiskInGb: Int
  volumeMountPath: String
  dockerArgs: String
  dockerId: String
  podType: PodType
  port: Int
  ports: String
  uptimeSeconds: Int
  lastStatusChange: String
  templateId: String
  networkVolumeId: String
  bidPerGpu: Float
  containerRegistryAuthId: String
  createdAt: String
}}

type PodMachineInfo {{
  podHostId: String
  gpuDisplayName: String
  gpuTypeId: String
  location: String
  publicIp: String
}}

type PodRuntime {{
  uptimeInSeconds: Int
  ports: [PodRuntimePorts]
  gpus: [PodRuntimeGpus]
  container: PodRuntimeContainer
}}

type PodRuntimePorts {{
  ip: String isIpPublic: Boolean privatePort: Int publicPort: Int type: String
}}
type PodRuntimeGpus {{ id: String gpuUtilPercent: Float memoryUtilPercent: Float }}
type PodRuntimeContainer {{ cpuPercent: Float memoryPercent: Float }}

type EnvironmentVariable {{ key: String value: String }}

type PodTemplate {{
  id: String
  name: String
  imageName: String
  dockerArgs: String
  containerDiskInGb: Int
  volumeInGb: Int
  volumeMountPath: String
  ports: String
  env: [EnvironmentVariable]
  isServerless: Boolean
  startSsh: Boolean
  isPublic: Boolean
  readme: String
  containerRegistryAuthId: String
}}
"""


def schema() -> GraphQLSchema:
    """A fresh schema (resolvers are bound onto it by ``graphql_resolvers.bind``)."""
    return build_schema(SDL)
